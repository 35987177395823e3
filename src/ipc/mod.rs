//! Single-node bootstrap: a full mesh of Unix stream sockets between the ranks of one job.
//!
//! Each rank listens on an abstract socket named from the job key and its rank; rank i connects
//! to every rank j < i, then accepts every rank above it. Both ends check `SO_PEERCRED` (same
//! uid); the connecting side proves it belongs to the job by presenting the unique id's random
//! secret. Every wait is bounded by `SYMMALLOC_TIMEOUT_S` and its error names the rank.
//!
//! Also what a job brings along: its shape and id from the launcher's variables (env.rs, for
//! `symm_comm_init_from_env`), the unique id (unique_id.rs) and this host's identity (host.rs).

pub mod env;
pub mod hex;
pub mod host;
pub mod mesh;
pub mod socket;
pub mod unique_id;

pub use mesh::Mesh;
pub use unique_id::UniqueId;
