//! Live events: the hub that handlers publish each experiment's events to and the live
//! streams subscribe to (`hub.rs`), and, on a PostgreSQL database shared by several
//! servers, the relay that hands each server's events to the others (`fanout.rs`).

pub mod fanout;
pub mod hub;
