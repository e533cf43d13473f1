//! The engine the SQL servers share (PostgreSQL on either driver, MySQL and MariaDB on sqlx):
//! a request's reservation is a row lock held by its open transaction. Written once over the
//! [`driver`] seam: the reservation ([`reserve`]), where a replay is found ([`replay_check`],
//! [`read_bound`]), what a transaction's owner and its handles share ([`tx_state`]), the
//! guard's lexer ([`guard`]), and the outbox, inbox, steps and admin logic ([`outbox`], [`steps`],
//! [`admin`]).
//! Each dialect's SQL is in its own folder (`src/postgres/`, `src/mysql/`), each driver's
//! code in its own (`src/tokio_postgres/`, `src/sqlx/`).

pub(crate) mod admin;
pub(crate) mod driver;
pub(crate) mod guard;
#[cfg(feature = "outbox")]
pub(crate) mod outbox;
#[cfg(feature = "outbox")]
pub(crate) mod outbox_sql;
pub(crate) mod read_bound;
pub(crate) mod replay_check;
pub(crate) mod reserve;
// Step-by-step requests: the logic once (`steps.rs`), the statements both servers run as
// written (`steps_sql.rs`; each dialect's own in its folder).
pub(crate) mod steps;
pub(crate) mod steps_sql;
#[cfg(test)]
pub(crate) mod test_records;
pub(crate) mod tx_state;
