//! The heap's release log: a page of shared memory (a memfd) in which a device heap records
//! every segment it gives back to the backend, so that the peers which mapped that segment
//! (comm/peer/retire.rs) unmap it too and its physical memory really goes back to the driver.
//!
//! Layout, in 64-bit words: word 0 counts the records ever written; record `i` lives at words
//! `1 + 2 * (i % CAP)` (the segment's offset) and `2 + 2 * (i % CAP)` (its generation).
//!
//! Invariants: one writer, the owning heap under its lock, which writes a record before it
//! release-stores the new count; readers (other processes, through a read-only mapping) read
//! records `[seen, count)`. A reader that fell more than `CAP` records behind, or whose records
//! were overwritten while it read them, drops them: it then keeps a mapping it could have
//! released (held until the communicator goes), and never unmaps one still in use, because a
//! record names an exact (offset, generation) and generations are never reused.

use crate::error::{Error, Result};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// Records the page holds before it wraps around.
pub const CAP: u64 = 4095;
const WORDS: usize = 1 + 2 * CAP as usize;
const LEN: usize = (WORDS * 8).next_multiple_of(4096);

fn os_err(what: &str) -> Error {
    Error::internal(format!(
        "release log: {what}: {}",
        std::io::Error::last_os_error()
    ))
}

/// A shared mapping of a log page (`writable` for the owner, read-only for peers).
struct Page {
    words: *mut AtomicU64,
}

impl Page {
    fn map(fd: BorrowedFd<'_>, writable: bool) -> Result<Page> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of LEN bytes of a memfd at least that long; the result
        // is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap"));
        }
        Ok(Page {
            words: p as *mut AtomicU64,
        })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < WORDS);
        // SAFETY: i < WORDS and the mapping is LEN >= WORDS * 8 bytes, 8-byte aligned (page
        // aligned); AtomicU64 has the layout of u64, and every access to the page is atomic.
        unsafe { &*self.words.add(i) }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.words as *mut libc::c_void, LEN) };
    }
}

// SAFETY: the page is shared memory accessed only through atomics; the pointer is owned.
unsafe impl Send for Page {}
// SAFETY: as Send: `&Page` only hands out `&AtomicU64` words of a mapping that lives as long as
// the page, so sharing it between threads (a peer's view, shared by communicators) is sound.
unsafe impl Sync for Page {}

/// The owner's side: records released segments.
pub struct ReleaseLog {
    fd: OwnedFd,
    page: Page,
}

impl ReleaseLog {
    pub fn new() -> Result<ReleaseLog> {
        // SAFETY: memfd_create with a static NUL-terminated name; the fd is checked.
        let raw =
            unsafe { libc::memfd_create(c"symmalloc-release-log".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: raw is a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on the memfd just made; zero-filled, so the count starts at 0.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), LEN as libc::off_t) } != 0 {
            return Err(os_err("ftruncate"));
        }
        let page = Page::map(std::os::fd::AsFd::as_fd(&fd), true)?;
        Ok(ReleaseLog { fd, page })
    }

    /// Records that the segment at `offset` of generation `generation` was given back.
    pub fn record(&mut self, offset: u64, generation: u64) {
        let n = self.page.word(0).load(Ordering::Relaxed);
        let slot = (n % CAP) as usize;
        self.page
            .word(1 + 2 * slot)
            .store(offset, Ordering::Relaxed);
        self.page
            .word(2 + 2 * slot)
            .store(generation, Ordering::Relaxed);
        self.page.word(0).store(n + 1, Ordering::Release);
    }

    /// A new descriptor of the page, for a peer to map read-only.
    pub fn export(&self) -> Result<OwnedFd> {
        self.fd
            .try_clone()
            .map_err(|e| Error::internal(format!("release log: dup: {e}")))
    }

    pub fn count(&self) -> u64 {
        self.page.word(0).load(Ordering::Relaxed)
    }
}

/// A peer's log, mapped read-only.
pub struct ReleaseView {
    page: Page,
}

impl ReleaseView {
    pub fn open(fd: BorrowedFd<'_>) -> Result<ReleaseView> {
        Ok(ReleaseView {
            page: Page::map(fd, false)?,
        })
    }

    /// How many records the owner has written.
    pub fn count(&self) -> u64 {
        self.page.word(0).load(Ordering::Acquire)
    }

    /// Appends to `out` the (offset, generation) records `[seen, count)` that are still intact,
    /// and returns `count`: the next call's `seen`.
    pub fn read_since(&self, seen: u64, out: &mut Vec<(u64, u64)>) -> u64 {
        let n = self.count();
        if n <= seen {
            return n;
        }
        let from = seen.max(n.saturating_sub(CAP));
        let start = out.len();
        for i in from..n {
            let slot = (i % CAP) as usize;
            let off = self.page.word(1 + 2 * slot).load(Ordering::Relaxed);
            let generation = self.page.word(2 + 2 * slot).load(Ordering::Relaxed);
            out.push((off, generation));
        }
        // Records the owner may have overwritten while they were read are dropped: writing
        // record `now` (not yet counted) overwrites record `now - CAP`.
        std::sync::atomic::fence(Ordering::Acquire);
        let now = self.page.word(0).load(Ordering::Relaxed);
        let intact_from = (now + 1).saturating_sub(CAP);
        if intact_from > from {
            let lost = (intact_from - from).min(n - from) as usize;
            out.drain(start..start + lost);
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_reader_sees_every_record_in_order_and_drops_what_wrapped_around() {
        let mut log = ReleaseLog::new().unwrap();
        let fd = log.export().unwrap();
        let view = ReleaseView::open(fd.as_fd()).unwrap();
        let mut got = Vec::new();
        assert_eq!(view.read_since(0, &mut got), 0);
        for i in 0..5 {
            log.record(i << 21, 100 + i);
        }
        let seen = view.read_since(0, &mut got);
        assert_eq!(seen, 5);
        assert_eq!(got, (0..5).map(|i| (i << 21, 100 + i)).collect::<Vec<_>>());
        got.clear();
        assert_eq!(view.read_since(seen, &mut got), 5, "nothing new");
        assert!(got.is_empty());
        // A reader CAP + 10 records behind gets the last CAP - 1, oldest first (the oldest
        // slot is the one the next record overwrites, so it never counts as intact).
        for i in 0..CAP + 10 {
            log.record(i, 1_000 + i);
        }
        let now = view.read_since(seen, &mut got);
        assert_eq!(now, 5 + CAP + 10);
        assert_eq!(got.len() as u64, CAP - 1);
        assert_eq!(got[0], (11, 1_011));
        assert_eq!(*got.last().unwrap(), (CAP + 9, 1_000 + CAP + 9));
        assert_eq!(log.count(), now);
    }
}
