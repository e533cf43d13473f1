//! 64 KiB JSON bodies of three shapes, for the fingerprint's cost and memory tests: a few
//! fields one of which is a large array of objects, a large string, a flat object with a few
//! thousand keys in no particular order.

pub const TARGET: usize = 64 * 1024;

/// `{"order":…,"customer":{…},"items":[{…},…]}`: a few fields, one a large array of objects.
pub fn array_of_objects() -> Vec<u8> {
    let mut body =
        String::from(r#"{"order":"ord-2041","customer":{"id":77,"name":"Ann"},"items":["#);
    let mut index = 0;
    while body.len() < TARGET - 120 {
        if index > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            r#"{{"sku":"SKU-{index:05}","quantity":{},"price":{}.{:02},"note":"gift \u00e9"}}"#,
            index % 7 + 1,
            index % 300,
            index % 100
        ));
        index += 1;
    }
    body.push_str(r#"],"currency":"EUR"}"#);
    body.into_bytes()
}

/// `{"id":1,"blob":"…"}` with a 64 KiB string (a few escapes in it).
pub fn large_string() -> Vec<u8> {
    let mut blob = String::new();
    let mut line = 0;
    while blob.len() < TARGET - 64 {
        blob.push_str(&format!(
            "line {line}: the quick brown fox \\\"jumps\\\"\\n"
        ));
        line += 1;
    }
    format!(r#"{{"id":1,"blob":"{blob}","kind":"note"}}"#).into_bytes()
}

/// `{"field_00000":"value 0",…}`: a flat object with a few thousand keys, shuffled.
pub fn flat_object() -> Vec<u8> {
    let mut members = Vec::new();
    let mut size = 2;
    let mut index = 0;
    while size < TARGET - 40 {
        let member = format!(r#""field_{index:05}":"value {index}""#);
        size += member.len() + 1;
        members.push(member);
        index += 1;
    }
    let count = members.len();
    let shuffled: Vec<&str> = (0..count)
        .map(|i| members[i * 7919 % count].as_str())
        .collect();
    format!("{{{}}}", shuffled.join(",")).into_bytes()
}

/// The head of the request these bodies come with: `POST /orders?dry_run=true`, JSON.
pub fn order_head() -> http::request::Parts {
    let (parts, ()) = http::Request::post("/orders?dry_run=true")
        .header("content-type", "application/json")
        .body(())
        .expect("a valid request")
        .into_parts();
    parts
}
