//! The full mesh of authenticated connections between the ranks of one job, and the few
//! collective operations the communicator needs over it (all-gather with fds, barrier).
//!
//! Hosts: before anything else a rank refuses an id made on another host (`check_host`), and
//! the handshake carries each side's host (`HostStamp`): a peer on another host (one reached
//! through an id without a host, or with `SYMMALLOC_HOST_ID` set otherwise) fails both sides at
//! once, naming the two ranks and hosts. Hello: magic, rank, world, secret, then the host stamp
//! (the secret is checked first, so strangers learn nothing); reply: magic, world, host stamp.

use super::host::{Host, HostStamp};
use super::socket::{peer_cred, recv_frame, send_frame, wait_readable};
use super::unique_id::{secrets_equal, UniqueId};
use crate::error::{Error, Result};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const HELLO: &[u8; 8] = b"SYMMHELO";
const ACK: &[u8; 8] = b"SYMMACK1";

/// Connections refused by this process (wrong uid, wrong secret, malformed hello).
pub static REFUSED: AtomicU64 = AtomicU64::new(0);

pub struct Mesh {
    pub rank: usize,
    pub world: usize,
    conns: Vec<Option<UnixStream>>,
    timeout: Duration,
}

fn io_err(rank: usize, what: &str, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::TimedOut => Error::timeout(format!("rank {rank} did not answer ({what})")),
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset => Error::peer(format!(
            "rank {rank} closed its connection ({what}): it exited or was killed"
        )),
        _ => Error::peer(format!("talking to rank {rank} ({what}): {e}")),
    }
}

/// Two ranks of one communicator on two hosts.
fn other_host(me: usize, mine: &Host, peer: usize, theirs: &HostStamp) -> Error {
    Error::invalid(format!(
        "rank {peer} runs on host {} and rank {me} on host {} [{}]: a communicator joins the \
         ranks of one host (one boot and network namespace); give each host its own unique id \
         (Python: symmalloc.HierCommunicator; README, \"Across nodes\")",
        theirs.describe(),
        mine.detail,
        super::hex::hex(&mine.stamp.digest[..4])
    ))
}

fn refuse(me: usize, s: &UnixStream, why: &str) {
    REFUSED.fetch_add(1, Ordering::Relaxed);
    let who = peer_cred(s).map_or("unknown".into(), |c| format!("pid {} uid {}", c.pid, c.uid));
    eprintln!("symmalloc: rank {me} refused a connection from {who}: {why}");
}

impl Mesh {
    /// Builds the mesh; returns once every rank is connected and authenticated.
    pub fn connect(id: &UniqueId, rank: usize, world: usize, timeout: Duration) -> Result<Mesh> {
        let deadline = Instant::now() + timeout;
        let host = Host::current()?;
        id.check_host(&host, rank)?;
        let stamp = host.stamp.to_bytes();
        // What a rank that waits in vain for its peers is told about hosts.
        let hint = match &id.host {
            Some(h) => format!(
                "; a rank on another host than {} refuses this id at once",
                h.describe()
            ),
            None => String::new(),
        };
        let my_uid = unsafe { libc::getuid() }; // SAFETY: getuid cannot fail.
        let name = id.socket_name(rank);
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::internal(format!("socket name: {e}")))?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| {
            if e.kind() == io::ErrorKind::AddrInUse {
                Error::invalid(format!(
                    "rank {rank} of this unique id is already taken by another process \
                     (two ranks with the same rank number, or init twice with one id?)"
                ))
            } else {
                Error::peer(format!("listening as rank {rank}: {e}"))
            }
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::peer(format!("listener: {e}")))?;
        let mut conns: Vec<Option<UnixStream>> = (0..world).map(|_| None).collect();

        // Connect downwards.
        #[allow(clippy::needless_range_loop)]
        for peer in 0..rank {
            let paddr = SocketAddr::from_abstract_name(id.socket_name(peer).as_bytes())
                .map_err(|e| Error::internal(format!("socket name: {e}")))?;
            let s = loop {
                match UnixStream::connect_addr(&paddr) {
                    Ok(s) => break s,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => {
                        return Err(Error::timeout(format!(
                            "rank {peer} did not come up within {:.0} s (last error: {e}){hint}",
                            timeout.as_secs_f64()
                        )))
                    }
                }
            };
            let cred = peer_cred(&s).map_err(|e| io_err(peer, "credentials", e))?;
            if cred.uid != my_uid {
                return Err(Error::peer(format!(
                    "the process listening as rank {peer} (pid {}) runs as uid {}, not {my_uid}",
                    cred.pid, cred.uid
                )));
            }
            let mut hello = HELLO.to_vec();
            hello.extend_from_slice(&(rank as u32).to_le_bytes());
            hello.extend_from_slice(&(world as u32).to_le_bytes());
            hello.extend_from_slice(&id.secret);
            hello.extend_from_slice(&stamp);
            send_frame(&s, &hello, &[]).map_err(|e| io_err(peer, "hello", e))?;
            let (ack, _) = recv_frame(&s, deadline).map_err(|e| io_err(peer, "hello reply", e))?;
            let their_host = (ack.len() > 12 && &ack[..8] == ACK)
                .then(|| HostStamp::from_bytes(&ack[12..]))
                .flatten()
                .ok_or_else(|| Error::peer(format!("rank {peer} sent a malformed reply")))?;
            if their_host.digest != host.stamp.digest {
                return Err(other_host(rank, &host, peer, &their_host));
            }
            let their_world = u32::from_le_bytes(ack[8..12].try_into().unwrap()) as usize;
            if their_world != world {
                return Err(Error::invalid(format!(
                    "world_size mismatch: rank {rank} was given {world}, rank {peer} {their_world}"
                )));
            }
            conns[peer] = Some(s);
        }

        // Accept upwards.
        while conns.iter().skip(rank + 1).any(Option::is_none) {
            if let Err(e) = wait_readable(listener.as_raw_fd(), deadline) {
                let missing: Vec<String> = (rank + 1..world)
                    .filter(|&r| conns[r].is_none())
                    .map(|r| format!("rank {r}"))
                    .collect();
                return Err(if e.kind() == io::ErrorKind::TimedOut {
                    Error::timeout(format!(
                        "{} did not connect to rank {rank} within {:.0} s{hint}",
                        missing.join(", "),
                        timeout.as_secs_f64()
                    ))
                } else {
                    Error::peer(format!("accepting as rank {rank}: {e}"))
                });
            }
            let s = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(Error::peer(format!("accept: {e}"))),
            };
            let _ = s.set_nonblocking(false);
            match peer_cred(&s) {
                Ok(c) if c.uid == my_uid => {}
                _ => {
                    refuse(rank, &s, "different user");
                    continue;
                }
            }
            // A stranger gets a short window to say hello, so it cannot stall the job.
            let hello_deadline = deadline.min(Instant::now() + Duration::from_secs(5));
            let hello = match recv_frame(&s, hello_deadline) {
                Ok((h, _)) => h,
                Err(e) => {
                    refuse(rank, &s, &format!("no valid hello ({e})"));
                    continue;
                }
            };
            if hello.len() < 8 + 8 + 32 || &hello[..8] != HELLO {
                refuse(rank, &s, "malformed hello");
                continue;
            }
            if !secrets_equal(&hello[16..48], &id.secret) {
                refuse(rank, &s, "wrong secret");
                continue;
            }
            let Some(their_host) = HostStamp::from_bytes(&hello[48..]) else {
                refuse(rank, &s, "malformed hello (no host: an older symmalloc?)");
                continue;
            };
            let peer = u32::from_le_bytes(hello[8..12].try_into().unwrap()) as usize;
            let their_world = u32::from_le_bytes(hello[12..16].try_into().unwrap()) as usize;
            let mut ack = ACK.to_vec();
            ack.extend_from_slice(&(world as u32).to_le_bytes());
            ack.extend_from_slice(&stamp);
            let _ = send_frame(&s, &ack, &[]);
            if their_host.digest != host.stamp.digest {
                return Err(other_host(rank, &host, peer, &their_host));
            }
            if their_world != world {
                return Err(Error::invalid(format!(
                    "world_size mismatch: rank {rank} was given {world}, rank {peer} {their_world}"
                )));
            }
            if peer <= rank || peer >= world || conns[peer].is_some() {
                refuse(
                    rank,
                    &s,
                    &format!("claims rank {peer}, which is not expected"),
                );
                continue;
            }
            conns[peer] = Some(s);
        }
        Ok(Mesh {
            rank,
            world,
            conns,
            timeout,
        })
    }

    fn conn(&self, peer: usize) -> &UnixStream {
        self.conns[peer].as_ref().expect("mesh connects every peer")
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// Sends `payload` (and `fds`) to every peer and receives every peer's message; entry `r`
    /// of the result is rank r's (this rank's own entry is its own payload, without fds).
    pub fn all_gather(
        &self,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
        what: &str,
    ) -> Result<Vec<(Vec<u8>, Vec<OwnedFd>)>> {
        self.all_gather_each(payload, |_| fds.to_vec(), what)
    }

    /// As `all_gather`, with descriptors of its own for each peer: `fds_to(peer)` goes to
    /// `peer` alone (a split's socket pairs, one end to each later rank).
    pub fn all_gather_each<'a>(
        &self,
        payload: &[u8],
        fds_to: impl Fn(usize) -> Vec<BorrowedFd<'a>>,
        what: &str,
    ) -> Result<Vec<(Vec<u8>, Vec<OwnedFd>)>> {
        for peer in (0..self.world).filter(|&p| p != self.rank) {
            send_frame(self.conn(peer), payload, &fds_to(peer))
                .map_err(|e| io_err(peer, what, e))?;
        }
        let deadline = self.deadline();
        let mut out = Vec::with_capacity(self.world);
        for peer in 0..self.world {
            if peer == self.rank {
                out.push((payload.to_vec(), Vec::new()));
            } else {
                out.push(recv_frame(self.conn(peer), deadline).map_err(|e| io_err(peer, what, e))?);
            }
        }
        Ok(out)
    }

    /// A mesh over connections made elsewhere (a split's socket pairs, sent over its parent's
    /// mesh): `conns[r]` talks to rank r (None for `rank` itself).
    pub fn from_connections(
        rank: usize,
        world: usize,
        conns: Vec<Option<UnixStream>>,
        timeout: Duration,
    ) -> Mesh {
        debug_assert!(conns.len() == world && conns[rank].is_none());
        Mesh {
            rank,
            world,
            conns,
            timeout,
        }
    }

    pub fn barrier(&self, what: &str) -> Result<()> {
        self.all_gather(&[], &[], what).map(drop)
    }

    /// Raw fds of the connections (for tests that count open descriptors).
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        self.conns.iter().flatten().map(|c| c.as_fd()).collect()
    }
}
