//! The example apps the tests use: the gRPC order app of `examples/grpc_orders.rs` (its own
//! module, served in-process so that a test can wrap its handler or change its layer), and the
//! example programs run as child processes.

#[path = "../../../examples/grpc/app.rs"]
pub mod grpc_orders;
pub mod process;
