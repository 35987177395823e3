//! Bytes as lowercase hex: how ids, keys and host digests appear in socket names and messages
//! (unique_id.rs, host.rs, mesh.rs, env.rs). A module of its own so that those files
//! need not import each other for it.

/// `b` as lowercase hex, two digits a byte.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
