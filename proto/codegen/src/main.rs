//! Generates `examples/grpc/orders.rs` from `proto/orders.proto`, or with `--check` tells
//! whether the checked-in copy is what the `.proto` generates (exit status 1 if not).

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let check = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--check") => true,
        Some(other) => {
            eprintln!("unknown argument {other:?}; usage: [--check]");
            return ExitCode::from(2);
        }
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let checked_in = root.join("examples/grpc/orders.rs");
    let generated = match generate(&root) {
        Ok(generated) => generated,
        Err(error) => {
            eprintln!("generating from proto/orders.proto failed: {error}");
            return ExitCode::FAILURE;
        }
    };
    if !check {
        if let Err(error) = std::fs::write(&checked_in, &generated) {
            eprintln!("writing examples/grpc/orders.rs failed: {error}");
            return ExitCode::FAILURE;
        }
        println!("wrote examples/grpc/orders.rs");
        return ExitCode::SUCCESS;
    }
    match std::fs::read_to_string(&checked_in) {
        Ok(current) if current == generated => {
            println!("examples/grpc/orders.rs is what proto/orders.proto generates");
            ExitCode::SUCCESS
        }
        Ok(_) => {
            eprintln!(
                "examples/grpc/orders.rs is not what proto/orders.proto generates; regenerate \
                 it with\n  cargo run -p tower-idempotency-proto-codegen"
            );
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("reading examples/grpc/orders.rs failed: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The code `proto/orders.proto` generates, with the vendored `protoc`.
fn generate(root: &Path) -> Result<String, Box<dyn std::error::Error>> {
    let out = tempfile::tempdir()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .emit_rerun_if_changed(false)
        .out_dir(out.path())
        .compile_with_config(
            config,
            &[root.join("proto/orders.proto")],
            &[root.join("proto")],
        )?;
    Ok(std::fs::read_to_string(out.path().join("orders.rs"))?)
}
