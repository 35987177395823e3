//! The crate's one error type: a status code (the C ABI's `symm_status_t`) plus a message that
//! names the offending value and what was expected. Every layer returns `Result<T>`; the FFI layer
//! turns an `Err` into a status and the thread-local `symm_last_error()` text.

use std::ffi::CStr;
use std::fmt;

/// Status codes of the C ABI. Values are fixed; new ones are only ever appended.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Success = 0,
    ErrInvalidArgument = 1,
    ErrOutOfMemory = 2,
    ErrCuda = 3,
    ErrNoDevice = 4,
    ErrNotSymmetric = 5,
    ErrPeer = 6,
    ErrTimeout = 7,
    ErrUnsupported = 8,
    ErrInternal = 9,
}

impl Status {
    /// The fixed, human-readable name of a status (what `symm_status_string` returns).
    pub fn describe(self) -> &'static CStr {
        match self {
            Status::Success => c"SYMM_SUCCESS: no error",
            Status::ErrInvalidArgument => c"SYMM_ERR_INVALID_ARGUMENT: an argument is invalid",
            Status::ErrOutOfMemory => c"SYMM_ERR_OUT_OF_MEMORY: out of device or heap memory",
            Status::ErrCuda => c"SYMM_ERR_CUDA: a CUDA driver call failed",
            Status::ErrNoDevice => c"SYMM_ERR_NO_DEVICE: no usable CUDA device or driver",
            Status::ErrNotSymmetric => c"SYMM_ERR_NOT_SYMMETRIC: ranks disagree on buffers",
            Status::ErrPeer => c"SYMM_ERR_PEER: a peer rank failed or refused",
            Status::ErrTimeout => c"SYMM_ERR_TIMEOUT: a wait exceeded SYMMALLOC_TIMEOUT_S",
            Status::ErrUnsupported => c"SYMM_ERR_UNSUPPORTED: not supported here",
            Status::ErrInternal => c"SYMM_ERR_INTERNAL: internal error (a bug in symmalloc)",
        }
    }

    /// The status with this C value, if any.
    pub fn from_raw(v: i32) -> Option<Status> {
        use Status::*;
        [
            Success,
            ErrInvalidArgument,
            ErrOutOfMemory,
            ErrCuda,
            ErrNoDevice,
            ErrNotSymmetric,
            ErrPeer,
            ErrTimeout,
            ErrUnsupported,
            ErrInternal,
        ]
        .into_iter()
        .find(|s| *s as i32 == v)
    }

    /// The C name alone (`SYMM_ERR_TIMEOUT`).
    pub fn name(self) -> &'static str {
        let text = self.describe().to_str().unwrap_or("");
        text.split(':').next().unwrap_or(text)
    }
}

/// An error: the status the C caller sees and the message `symm_last_error()` returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Error {
            status,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Status::ErrInvalidArgument, message)
    }
    pub fn oom(message: impl Into<String>) -> Self {
        Self::new(Status::ErrOutOfMemory, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Status::ErrInternal, message)
    }
    pub fn peer(message: impl Into<String>) -> Self {
        Self::new(Status::ErrPeer, message)
    }
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(Status::ErrTimeout, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(Status::ErrUnsupported, message)
    }
    pub fn not_symmetric(message: impl Into<String>) -> Self {
        Self::new(Status::ErrNotSymmetric, message)
    }
    /// Prefixes the message with context ("while X: ...").
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.status, self.message)
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::peer(format!("I/O error: {e}"))
    }
}
