//! This process's host identity: what decides whether two ranks can be in one communicator.
//!
//! Ranks meet over abstract Unix sockets and pass memory as file descriptors, so two ranks can
//! share a communicator exactly when they run on one kernel (one boot) and in one network
//! namespace (abstract socket names are per namespace). The identity is therefore the kernel's
//! boot id (`/proc/sys/kernel/random/boot_id`) and the network namespace's inode
//! (`/proc/self/ns/net`); the host name only labels it in messages (containers on one host
//! may have other names and still share everything; two machines may have one name).
//! `SYMMALLOC_HOST_ID` (config/settings.rs) replaces the identity: tests use it to run several
//! "hosts" on one machine.
//!
//! Invariant: two processes get equal digests iff their identity strings are equal; a process
//! computes its identity the same way every time (the inputs cannot change while it runs,
//! except the override, which is read at each call, like every setting read at init).

use crate::config;
use crate::error::Result;

/// The most bytes of a host name carried in a unique id or a handshake.
pub const NAME_BYTES: usize = config::MAX_HOST_ID;

/// A host as other ranks see it: a digest of its identity and a short name for messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostStamp {
    pub digest: [u8; 16],
    /// At most `NAME_BYTES` bytes of UTF-8.
    pub name: String,
}

impl HostStamp {
    /// `'name' [digest prefix]`: the digest tells two hosts of one name apart.
    pub fn describe(&self) -> String {
        format!("'{}' [{}]", self.name, super::hex::hex(&self.digest[..4]))
    }

    /// Digest, name length, name: `16 + 1 + name.len()` bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = self.digest.to_vec();
        b.push(self.name.len() as u8);
        b.extend_from_slice(self.name.as_bytes());
        b
    }

    /// The inverse of `to_bytes`, over exactly that many bytes; `None` if malformed.
    pub fn from_bytes(b: &[u8]) -> Option<HostStamp> {
        if b.len() < 17 || b.len() != 17 + b[16] as usize || b[16] as usize > NAME_BYTES {
            return None;
        }
        Some(HostStamp {
            digest: b[..16].try_into().ok()?,
            name: String::from_utf8_lossy(&b[17..]).into_owned(),
        })
    }
}

/// This process's host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub stamp: HostStamp,
    /// How the identity was found, for messages about this host.
    pub detail: String,
}

/// 128 bits of FNV-1a over `s`: two 64-bit hashes with different offsets.
fn digest(s: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (half, chunk) in out.chunks_mut(8).enumerate() {
        let mut x: u64 = 0xcbf29ce484222325 ^ (0x9e37_79b9 * (half as u64 + 1));
        for b in s.bytes() {
            x ^= b as u64;
            x = x.wrapping_mul(0x100000001b3);
        }
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    out
}

/// The first `NAME_BYTES` bytes of `s`, cut at a character boundary.
fn short(s: &str) -> String {
    let mut end = s.len().min(NAME_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length; gethostname NUL-terminates within it on success.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if r != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned()).filter(|s| !s.is_empty())
}

impl Host {
    /// The host of this process: `SYMMALLOC_HOST_ID` when set, else read from the kernel.
    pub fn current() -> Result<Host> {
        if let Some(id) = config::host_id()? {
            return Ok(Host::from_override(&id));
        }
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty());
        let netns = std::fs::read_link("/proc/self/ns/net")
            .ok()
            .map(|p| p.to_string_lossy().into_owned());
        Ok(Host::from_kernel(
            boot.as_deref(),
            netns.as_deref(),
            hostname().as_deref(),
        ))
    }

    /// A host named by `SYMMALLOC_HOST_ID`.
    pub fn from_override(id: &str) -> Host {
        Host {
            stamp: HostStamp {
                digest: digest(&format!("symmalloc-host/override/{id}")),
                name: short(id),
            },
            detail: format!("'{id}' (SYMMALLOC_HOST_ID)"),
        }
    }

    /// A host from what the kernel says (a pure function, for tests): the boot id and the
    /// network namespace decide; without a boot id the host name stands in for it.
    pub fn from_kernel(boot: Option<&str>, netns: Option<&str>, name: Option<&str>) -> Host {
        let name = name.unwrap_or("unnamed host");
        let who = match boot {
            Some(b) => format!("boot:{b}"),
            None => format!("hostname:{name}"),
        };
        let ns = netns.unwrap_or("net:[?]");
        let ino = ns.trim_start_matches("net:[").trim_end_matches(']');
        Host {
            stamp: HostStamp {
                digest: digest(&format!("symmalloc-host/{who}/{ns}")),
                name: short(name),
            },
            detail: format!(
                "'{name}' (boot id {}, network namespace {ino})",
                boot.map_or("unknown", |b| &b[..b.len().min(8)])
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_and_namespace_decide_the_name_does_not() {
        let a = Host::from_kernel(Some("b1"), Some("net:[4026531840]"), Some("node-a"));
        let renamed = Host::from_kernel(Some("b1"), Some("net:[4026531840]"), Some("other"));
        assert_eq!(a.stamp.digest, renamed.stamp.digest);
        let rebooted = Host::from_kernel(Some("b2"), Some("net:[4026531840]"), Some("node-a"));
        let other_ns = Host::from_kernel(Some("b1"), Some("net:[4026532001]"), Some("node-a"));
        assert_ne!(a.stamp.digest, rebooted.stamp.digest);
        assert_ne!(a.stamp.digest, other_ns.stamp.digest);
        assert!(a.detail.contains("node-a") && a.detail.contains("4026531840"));
        let o = Host::from_override("node-a");
        assert_ne!(o.stamp.digest, a.stamp.digest);
        assert_eq!(o.stamp, Host::from_override("node-a").stamp);
        assert_ne!(o.stamp.digest, Host::from_override("node-b").stamp.digest);
    }

    #[test]
    fn stamps_round_trip_and_refuse_garbage() {
        let long = "h".repeat(200);
        let h = Host::from_kernel(Some("b"), None, Some(&long));
        assert_eq!(h.stamp.name.len(), NAME_BYTES);
        let b = h.stamp.to_bytes();
        assert_eq!(HostStamp::from_bytes(&b), Some(h.stamp.clone()));
        assert_eq!(HostStamp::from_bytes(&b[..b.len() - 1]), None);
        assert_eq!(HostStamp::from_bytes(&[0u8; 10]), None);
        let mut too_long = vec![0u8; 16];
        too_long.push(200);
        too_long.extend(std::iter::repeat_n(b'x', 200));
        assert_eq!(HostStamp::from_bytes(&too_long), None);
        // A multi-byte character at the cut is dropped whole.
        let h = Host::from_kernel(
            None,
            None,
            Some(&format!("{}é", "x".repeat(NAME_BYTES - 1))),
        );
        assert_eq!(h.stamp.name, "x".repeat(NAME_BYTES - 1));
    }

    #[test]
    fn this_process_has_a_host() {
        let h = Host::current().unwrap();
        assert!(!h.stamp.name.is_empty());
    }
}
