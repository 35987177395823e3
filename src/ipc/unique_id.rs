//! The unique id: 128 plain bytes a caller sends to every rank. Layout: magic (8), job key (16),
//! secret (32), zero padding. The key names the sockets; the secret authenticates ranks.

use crate::error::{Error, Result};
use std::io::Read;

pub const ID_BYTES: usize = 128;
const MAGIC: &[u8; 8] = b"SYMMID01";

#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    pub key: [u8; 16],
    pub secret: [u8; 32],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({})", hex(&self.key))
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn random(buf: &mut [u8]) -> Result<()> {
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|e| Error::internal(format!("reading /dev/urandom: {e}")))
}

impl UniqueId {
    pub fn generate() -> Result<Self> {
        let mut id = UniqueId {
            key: [0; 16],
            secret: [0; 32],
        };
        random(&mut id.key)?;
        random(&mut id.secret)?;
        Ok(id)
    }

    /// A job id derived from a shared string (torchrun/mpirun variables). The secret is derived
    /// from the same string: it keeps out strangers' jobs, not processes that can read the
    /// environment of ours.
    pub fn from_job_key(job: &str) -> Self {
        let h = |salt: u64| -> [u8; 16] {
            // FNV-1a over salt and the job string, twice with different salts per half.
            let mut out = [0u8; 16];
            for (half, chunk) in out.chunks_mut(8).enumerate() {
                let mut x: u64 = 0xcbf29ce484222325 ^ (salt * 2 + half as u64);
                for b in job.bytes() {
                    x ^= b as u64;
                    x = x.wrapping_mul(0x100000001b3);
                }
                chunk.copy_from_slice(&x.to_le_bytes());
            }
            out
        };
        let mut secret = [0u8; 32];
        secret[..16].copy_from_slice(&h(7));
        secret[16..].copy_from_slice(&h(11));
        UniqueId { key: h(3), secret }
    }

    pub fn to_bytes(&self) -> [u8; ID_BYTES] {
        let mut b = [0u8; ID_BYTES];
        b[..8].copy_from_slice(MAGIC);
        b[8..24].copy_from_slice(&self.key);
        b[24..56].copy_from_slice(&self.secret);
        b
    }

    /// The id from the 256 hex digits of its bytes (as `SYMMALLOC_UNIQUE_ID` carries it).
    pub fn from_hex(s: &str) -> Result<Self> {
        let bad = || {
            let shown: String = s.chars().take(16).collect();
            Error::invalid(format!(
                "{:?}{} ({} characters) is not an id: expected the 256 hex digits of the 128 \
                 bytes of symm_get_unique_id",
                shown,
                if s.chars().count() > 16 { "..." } else { "" },
                s.len()
            ))
        };
        if s.len() != 2 * ID_BYTES || !s.is_ascii() {
            return Err(bad());
        }
        let mut b = [0u8; ID_BYTES];
        for (i, byte) in b.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Self::from_bytes(&b)
    }

    pub fn from_bytes(b: &[u8; ID_BYTES]) -> Result<Self> {
        if &b[..8] != MAGIC {
            return Err(Error::invalid(format!(
                "unique id does not start with the symmalloc magic (found bytes {}); expected \
                 an id made by symm_get_unique_id",
                hex(&b[..8])
            )));
        }
        if b[56..].iter().any(|&x| x != 0) {
            return Err(Error::invalid(
                "unique id has non-zero padding; it was altered",
            ));
        }
        let mut id = UniqueId {
            key: [0; 16],
            secret: [0; 32],
        };
        id.key.copy_from_slice(&b[8..24]);
        id.secret.copy_from_slice(&b[24..56]);
        Ok(id)
    }

    /// Abstract socket name of `rank`'s listener.
    pub fn socket_name(&self, rank: usize) -> String {
        format!("symmalloc.{}.{rank}", hex(&self.key))
    }
}

/// Compares secrets in constant time.
pub fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn roundtrip_and_garbage() {
        let id = UniqueId::generate().unwrap();
        assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
        assert_ne!(UniqueId::generate().unwrap(), id);
        let garbage = [0x5au8; ID_BYTES];
        let e = UniqueId::from_bytes(&garbage).unwrap_err();
        assert!(e.message.contains("magic"), "{}", e.message);
        let mut tampered = id.to_bytes();
        tampered[100] = 1;
        assert!(UniqueId::from_bytes(&tampered).is_err());
        assert_eq!(UniqueId::from_job_key("a:1"), UniqueId::from_job_key("a:1"));
        assert_ne!(
            UniqueId::from_job_key("a:1").key,
            UniqueId::from_job_key("a:2").key
        );
        assert!(secrets_equal(&[1, 2], &[1, 2]) && !secrets_equal(&[1, 2], &[1, 3]));
    }
}
