//! The example apps the tests use, each the very module its example program serves: the gRPC
//! order app of `examples/grpc_orders.rs` (served in-process so that a test can wrap its
//! handler or change its layer), the HTTP order app of `examples/orders.rs` (the client tests'
//! server, [`client_common`](crate::client_common)) and the inventory app of
//! `examples/inventory.rs` (the outbox tests' receiver on PostgreSQL,
//! [`pg_common::inventory`](crate::pg_common::inventory)); and the example programs
//! run as child processes.

#[path = "../../../examples/grpc/app.rs"]
pub mod grpc_orders;
#[path = "../../../examples/inventory/app.rs"]
pub mod inventory;
// Like the gRPC app, it brings the order examples' `common/order_table.rs` as its program has
// it: two apps in one test crate load that file twice, as two modules with types of their own.
#[allow(clippy::duplicate_mod)]
#[path = "../../../examples/orders/app.rs"]
pub mod orders;
pub mod process;
