#!/usr/bin/env bash
# CI: the snippets a newcomer copies build as a crate of their own, with only the
# `[dependencies]` the page lists beside them. The doc tests compile the same code with this
# repository's dev-dependencies, which hide a crate the page forgets to list.
#
# Each snippet: the first ```toml block holding `[dependencies]` after a marker line of a page,
# and the first Rust block after it. Its crate is written to a temporary directory, with the
# block's `tower-idempotency` taken from this repository by path (same features), the
# repository's Cargo.lock (the same versions as the tests), and built with `cargo build`. A
# warning in the snippet's own code fails too. rustdoc's hidden lines (`# ...`) are left out:
# a reader copies what the page shows.
#
# The builds share `target/readme-snippet` (SNIPPET_TARGET_DIR elsewhere), so a second run
# compiles only what changed. Pass --offline (or set CARGO_NET_OFFLINE=true) when the
# registry cannot be reached and its crates are in Cargo's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"

export CARGO_TARGET_DIR="${SNIPPET_TARGET_DIR:-$repo/target/readme-snippet}"
export CARGO_TERM_COLOR=never
# As .ci/run (so that a shared target directory reuses its builds): no incremental state,
# line tables only.
export CARGO_INCREMENTAL=0
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
cargo_flags=()
if [[ "${1:-}" == "--offline" ]]; then cargo_flags+=(--offline); fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failed=0

# Prints the `[dependencies]` block (without its fences) of the snippet after the first line
# of FILE that is MARKER (the whole line; empty for the file's start).
deps_block() {
  awk -v marker="$2" '
    !started { if (marker == "" || $0 == marker) started = 1; else next }
    !inblock && /^```toml/ { inblock = 1; block = ""; next }
    inblock && /^```/ { if (block ~ /\[dependencies\]/) { printf "%s", block; exit } inblock = 0; next }
    inblock { block = block $0 "\n" }
  ' "$1"
}

# Prints the first Rust block after that `[dependencies]` block, without rustdoc's hidden
# lines. A Rust block: a fence with no info string, or one naming rust, no_run, should_panic,
# compile_fail... (not toml, sh, text).
code_block() {
  awk -v marker="$2" '
    !started { if (marker == "" || $0 == marker) started = 1; else next }
    !seen_deps && /^```toml/ { intoml = 1; next }
    intoml && /\[dependencies\]/ { has_deps = 1 }
    intoml && /^```/ { intoml = 0; if (has_deps) seen_deps = 1; next }
    intoml { next }
    !seen_deps { next }
    skipping && /^```/ { skipping = 0; next }
    skipping { next }
    !incode && /^```/ {
      info = substr($0, 4)
      if (info == "" || info ~ /^(rust|no_run|should_panic|edition20[0-9][0-9])(,|$)/) { incode = 1; next }
      skipping = 1; next
    }
    incode && /^```/ { exit }
    incode && /^[ \t]*#( |$)/ { next }
    incode { print }
  ' "$1"
}

# Writes the snippet of FILE after MARKER as a crate in DIR and builds it.
check() {
  local file="$1" marker="$2" name="$3"
  local dir="$work/$name" deps code
  deps="$(deps_block "$file" "$marker")"
  code="$(code_block "$file" "$marker")"
  if [[ -z "$deps" || -z "$code" ]]; then
    echo "$file: no [dependencies] block and Rust block after '${marker:-the start}'" >&2
    return 1
  fi
  if ! grep -q '^tower-idempotency *=' <<<"$deps"; then
    echo "$file: the [dependencies] block after '${marker:-the start}' does not list tower-idempotency" >&2
    return 1
  fi
  mkdir -p "$dir/src"
  # `tower-idempotency = "0.1"` or `{ version = "0.1", ... }` -> this repository, by path.
  deps="$(sed -E \
    -e '/^tower-idempotency *=/ s#= *"[^"]*" *$#= { path = "'"$repo"'" }#' \
    -e '/^tower-idempotency *=/ s#version *= *"[^"]*"#path = "'"$repo"'"#' <<<"$deps")"
  {
    printf '[package]\nname = "%s"\nversion = "0.0.0"\nedition = "2021"\npublish = false\n\n' "$name"
    printf '%s\n\n' "$deps"
    # A workspace of its own: not a member of any workspace above the temporary directory.
    printf '[workspace]\n'
  } >"$dir/Cargo.toml"
  # A snippet without `fn main` is a library's code (its functions used by the reader's own
  # code, not here); with it, a program.
  if grep -q 'fn main' <<<"$code"; then
    printf '%s\n' "$code" >"$dir/src/main.rs"
  else
    printf '#![allow(dead_code)]\n%s\n' "$code" >"$dir/src/lib.rs"
  fi
  cp "$repo/Cargo.lock" "$dir/Cargo.lock"

  echo "== $file (${marker:-first snippet}): $(grep -c '' <<<"$code") lines of Rust with"
  grep -v '^\[' <<<"$deps" | sed 's/^/   /'
  local start=$SECONDS out
  if ! out="$(cd "$dir" && cargo build "${cargo_flags[@]}" --quiet --message-format short 2>&1)"; then
    printf '%s\n' "$out" >&2
    echo "$file: the snippet after '${marker:-the start}' does not build with the dependencies it lists" >&2
    return 1
  fi
  # The snippet's own warnings (a dependency's are capped, this repository's are .ci/run's).
  if grep -E '^src/(main|lib)\.rs:[0-9]+:[0-9]+: warning' <<<"$out" >&2; then
    echo "$file: the snippet after '${marker:-the start}' builds with warnings" >&2
    return 1
  fi
  echo "   builds ($((SECONDS - start)) s)"
}

check README.md "" readme-snippet || failed=1
check src/docs/sqlx_postgres.md "# A complete handler" sqlx-postgres-snippet || failed=1
# The other guides' handlers, on request: each compiles another driver (about a minute more).
if [[ "${SNIPPETS:-}" == all ]]; then
  check src/docs/postgres.md "" tokio-postgres-snippet || failed=1
  check src/docs/sqlx_mysql.md "" sqlx-mysql-snippet || failed=1
fi
exit "$failed"
