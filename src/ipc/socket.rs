//! Framed messages over a connected Unix stream socket, with file descriptors passed as
//! `SCM_RIGHTS` ancillary data, deadline-bounded reads and the peer's credentials.
//!
//! Frame: `u32 length, u32 fd count` (little endian), then `length` payload bytes; the fds ride
//! on the frame's first byte. At most `MAX_FDS` fds per frame.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

pub const MAX_FDS: usize = 16;
const MAX_FRAME: u32 = 64 << 20;

/// The credentials the kernel recorded for the other end of `s`.
pub fn peer_cred(s: &UnixStream) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred/len describe a writable ucred; s is a live socket.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// Waits until `fd` is readable or the deadline passes.
pub fn wait_readable(fd: i32, deadline: Instant) -> io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r > 0 {
            return Ok(());
        }
    }
}

fn cmsg_space() -> usize {
    // SAFETY: CMSG_SPACE is a pure size computation.
    unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<i32>()) as u32) as usize }
}

/// Sends one frame; `fds` are duplicated into the receiver.
pub fn send_frame(s: &UnixStream, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS, "at most {MAX_FDS} fds per frame");
    let mut header = [0u8; 8];
    header[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    header[4..].copy_from_slice(&(fds.len() as u32).to_le_bytes());
    let mut frame = Vec::with_capacity(8 + payload.len());
    frame.extend_from_slice(&header);
    frame.extend_from_slice(payload);
    let mut cbuf = vec![0u8; cmsg_space()];
    let mut sent = 0;
    while sent < frame.len() {
        let mut iov = libc::iovec {
            iov_base: frame[sent..].as_ptr() as *mut libc::c_void,
            iov_len: frame.len() - sent,
        };
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if sent == 0 && !fds.is_empty() {
            let data_len = std::mem::size_of_val(fds.first().unwrap()) * fds.len();
            msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            // SAFETY: CMSG_SPACE/CMSG_LEN are pure size computations.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(data_len as u32) } as usize;
            // SAFETY: msg_control points at cbuf, large enough for one cmsg of MAX_FDS fds.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(data_len as u32) as usize;
                let data = libc::CMSG_DATA(c) as *mut i32;
                for (i, fd) in fds.iter().enumerate() {
                    data.add(i).write_unaligned(fd.as_raw_fd());
                }
            }
        }
        // SAFETY: msg describes valid buffers; MSG_NOSIGNAL turns a dead peer into EPIPE.
        let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes, collecting any fds that arrive; EOF is `UnexpectedEof`.
fn recv_exact(
    s: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    deadline: Instant,
) -> io::Result<()> {
    let mut got = 0;
    let mut cbuf = vec![0u8; cmsg_space()];
    while got < buf.len() {
        wait_readable(s.as_raw_fd(), deadline)?;
        let mut iov = libc::iovec {
            iov_base: buf[got..].as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len() - got,
        };
        // SAFETY: zeroed msghdr is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = cbuf.len();
        // SAFETY: msg describes valid writable buffers; fds received get CLOEXEC.
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if matches!(
                e.kind(),
                io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
            ) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: walking the control buffer the kernel filled, within msg_controllen.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                    let data = libc::CMSG_DATA(c) as *const i32;
                    for i in 0..n {
                        fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed",
            ));
        }
        got += n as usize;
    }
    Ok(())
}

/// Receives one frame before `deadline`.
pub fn recv_frame(s: &UnixStream, deadline: Instant) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut fds = Vec::new();
    let mut header = [0u8; 8];
    recv_exact(s, &mut header, &mut fds, deadline)?;
    let len = u32::from_le_bytes(header[..4].try_into().unwrap());
    let nfds = u32::from_le_bytes(header[4..].try_into().unwrap()) as usize;
    if len > MAX_FRAME || nfds > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "malformed frame header",
        ));
    }
    let mut payload = vec![0u8; len as usize];
    recv_exact(s, &mut payload, &mut fds, deadline)?;
    if fds.len() != nfds {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame announced {nfds} fds, carried {}", fds.len()),
        ));
    }
    Ok((payload, fds))
}
