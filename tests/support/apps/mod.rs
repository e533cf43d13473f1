//! The example apps the tests use: the gRPC order app served in-process, and the example
//! programs run as child processes.

pub mod grpc_orders;
pub mod process;
