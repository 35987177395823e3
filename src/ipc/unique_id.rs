//! The unique id: 128 plain bytes a caller sends to every rank. Layout: magic (8), job key (16),
//! secret (32), the host it was made on (digest 16, name length 1, name up to 55), zero padding.
//! The key names the sockets; the secret authenticates ranks; the host lets a rank on another
//! host refuse the id at once (`check_host`) instead of waiting for peers it cannot reach.
//!
//! The Python package reads bytes 56..128 of a fresh id as this process's host
//! (`symmalloc.hier`): keep that range the `HostStamp` layout. Ids of the first layout
//! (`SYMMID01`, zeros after the secret) are still accepted and carry no host; a v2 id with an
//! all-zero digest carries none either (`UniqueId::host` = `None`).

use super::hex::hex;
use super::host::{Host, HostStamp};
use crate::error::{Error, Result};
use std::io::Read;

pub const ID_BYTES: usize = 128;
const MAGIC_V1: &[u8; 8] = b"SYMMID01";
const MAGIC: &[u8; 8] = b"SYMMID02";
/// Where the host stamp starts in the id's bytes.
pub const HOST_OFFSET: usize = 56;

#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    pub key: [u8; 16],
    pub secret: [u8; 32],
    /// The host whose ranks may use the id (`None`: any; the handshake still compares hosts).
    pub host: Option<HostStamp>,
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({})", hex(&self.key))
    }
}

fn random(buf: &mut [u8]) -> Result<()> {
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|e| Error::internal(format!("reading /dev/urandom: {e}")))
}

/// 128 bits of FNV-1a over `job` (two halves, each salted).
fn job_hash(job: &str, salt: u64) -> [u8; 16] {
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
}

impl UniqueId {
    /// A fresh id for the ranks of this process's host.
    pub fn generate() -> Result<Self> {
        Self::generate_for(&Host::current()?)
    }

    /// A fresh id for the ranks of `host`.
    pub fn generate_for(host: &Host) -> Result<Self> {
        let mut id = UniqueId {
            key: [0; 16],
            secret: [0; 32],
            host: Some(host.stamp.clone()),
        };
        random(&mut id.key)?;
        random(&mut id.secret)?;
        Ok(id)
    }

    /// A job id derived from a shared string (torchrun/mpirun variables) and this rank's host:
    /// the ranks of one host meet, those of other hosts (same variables) get other sockets.
    /// The secret is derived from the same string: it keeps out strangers' jobs, not processes
    /// that can read the environment of ours.
    pub fn from_job_key(job: &str, host: &Host) -> Self {
        let job = format!("{job}@{}", hex(&host.stamp.digest));
        let mut secret = [0u8; 32];
        secret[..16].copy_from_slice(&job_hash(&job, 7));
        secret[16..].copy_from_slice(&job_hash(&job, 11));
        UniqueId {
            key: job_hash(&job, 3),
            secret,
            host: Some(host.stamp.clone()),
        }
    }

    pub fn to_bytes(&self) -> [u8; ID_BYTES] {
        let mut b = [0u8; ID_BYTES];
        b[..8].copy_from_slice(MAGIC);
        b[8..24].copy_from_slice(&self.key);
        b[24..56].copy_from_slice(&self.secret);
        if let Some(h) = &self.host {
            let s = h.to_bytes();
            b[HOST_OFFSET..HOST_OFFSET + s.len()].copy_from_slice(&s);
        }
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
        let altered = || Error::invalid("unique id has non-zero padding; it was altered");
        let host = match &b[..8] {
            m if m == MAGIC_V1 => {
                if b[HOST_OFFSET..].iter().any(|&x| x != 0) {
                    return Err(altered());
                }
                None
            }
            m if m == MAGIC => {
                let len = 17 + b[HOST_OFFSET + 16] as usize;
                let stamp = b
                    .get(HOST_OFFSET..HOST_OFFSET + len)
                    .and_then(HostStamp::from_bytes)
                    .ok_or_else(altered)?;
                if b[HOST_OFFSET + len..].iter().any(|&x| x != 0) {
                    return Err(altered());
                }
                Some(stamp).filter(|s| s.digest != [0; 16])
            }
            _ => {
                return Err(Error::invalid(format!(
                    "unique id does not start with the symmalloc magic (found bytes {}); \
                     expected an id made by symm_get_unique_id",
                    hex(&b[..8])
                )))
            }
        };
        let mut id = UniqueId {
            key: [0; 16],
            secret: [0; 32],
            host,
        };
        id.key.copy_from_slice(&b[8..24]);
        id.secret.copy_from_slice(&b[24..56]);
        Ok(id)
    }

    /// Refuses, before any wait, an id made on another host than `me` (rank `rank`'s): its
    /// peers are out of reach of this host's sockets.
    pub fn check_host(&self, me: &Host, rank: usize) -> Result<()> {
        match &self.host {
            Some(h) if h.digest != me.stamp.digest => Err(Error::invalid(format!(
                "rank {rank} runs on host {} [{}], but its unique id was made on host {}: a \
                 communicator joins the ranks of one host (one boot and network namespace), and \
                 ranks of other hosts cannot reach its sockets. Make the id on this host, or, \
                 for a job over several hosts, one communicator per host (Python: \
                 symmalloc.HierCommunicator; README, \"Across nodes\")",
                me.detail,
                hex(&me.stamp.digest[..4]),
                h.describe()
            ))),
            _ => Ok(()),
        }
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
        tampered[120] = 1;
        assert!(UniqueId::from_bytes(&tampered).is_err());
        let mut tampered = id.to_bytes();
        tampered[HOST_OFFSET + 16] = 100; // a name longer than the id holds
        assert!(UniqueId::from_bytes(&tampered).is_err());
        let a = Host::from_override("a");
        assert_eq!(
            UniqueId::from_job_key("a:1", &a),
            UniqueId::from_job_key("a:1", &a)
        );
        assert_ne!(
            UniqueId::from_job_key("a:1", &a).key,
            UniqueId::from_job_key("a:2", &a).key
        );
        // The same job on another host gets other sockets.
        assert_ne!(
            UniqueId::from_job_key("a:1", &a).key,
            UniqueId::from_job_key("a:1", &Host::from_override("b")).key
        );
        assert!(secrets_equal(&[1, 2], &[1, 2]) && !secrets_equal(&[1, 2], &[1, 3]));
    }

    #[test]
    fn an_id_names_its_host_and_refuses_other_hosts() {
        let (a, b) = (Host::from_override("node-a"), Host::from_override("node-b"));
        let id = UniqueId::generate_for(&a).unwrap();
        let back = UniqueId::from_bytes(&id.to_bytes()).unwrap();
        assert_eq!(back.host.as_ref().unwrap().name, "node-a");
        back.check_host(&a, 0).unwrap();
        let e = back.check_host(&b, 3).unwrap_err();
        assert_eq!(e.status, crate::error::Status::ErrInvalidArgument);
        for part in ["rank 3", "'node-b'", "'node-a'", "one host"] {
            assert!(e.message.contains(part), "{part}: {}", e.message);
        }
        // An id of the first layout carries no host and is taken anywhere.
        let mut v1 = id.to_bytes();
        v1[..8].copy_from_slice(MAGIC_V1);
        v1[HOST_OFFSET..].fill(0);
        let old = UniqueId::from_bytes(&v1).unwrap();
        assert_eq!((old.key, old.host.clone()), (id.key, None));
        old.check_host(&b, 0).unwrap();
        // A v2 id without a host (all-zero stamp) too.
        let hostless = UniqueId { host: None, ..id };
        let b2 = hostless.to_bytes();
        assert_eq!(&b2[..8], MAGIC);
        assert_eq!(UniqueId::from_bytes(&b2).unwrap().host, None);
    }
}
