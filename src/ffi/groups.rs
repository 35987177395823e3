//! The C ABI of groups (DESIGN v3, "Groups"): `symm_comm_split`, per-communicator memory
//! (`symm_comm_malloc` / `symm_comm_free`), `symm_comm_info`, and the MemPool slots through
//! which a torch `MemPool` allocates from a communicator's arena (`symm_comm_pool_malloc_<k>`,
//! one function per slot, because torch's pluggable allocator passes no pool id; they are
//! exported for dlsym and left out of the header).

use super::guard::{guard_ptr, guard_status, guard_void};
use super::types::*;
use super::{register, stream_of, symm_comm_t, with_comm};
use crate::comm::registry;
use crate::error::{Error, Result};
use crate::heap;
use std::ffi::{c_int, c_void};

/// `color` of a rank that takes part in `symm_comm_split` but wants no child.
pub const SYMM_SPLIT_NOCOLOR: i32 = -1;
/// The most live communicators per process and device; one more fails on every rank alike.
pub const SYMM_MAX_COMMS_PER_DEVICE: i32 = 16;
/// MemPool slots per process (`symm_comm_mem_pool_slot`).
pub const SYMM_COMM_POOL_SLOTS: i32 = 64;
const _: () = assert!(
    SYMM_MAX_COMMS_PER_DEVICE as usize == registry::MAX_COMMS_PER_DEVICE
        && SYMM_COMM_POOL_SLOTS as usize == registry::POOL_SLOTS
);

/// What `symm_comm_info` reports about a communicator. May grow at the end: pass its size.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct symm_comm_info_t {
    /// This rank in the communicator, and how many ranks it has.
    pub rank: i32,
    pub world_size: i32,
    pub device: i32,
    /// Live communicators of this process on `device`, this one included.
    pub comms_on_device: i32,
    /// The communicator's arena: its heap offset (equal on every rank) and length.
    pub arena_offset: u64,
    pub arena_bytes: u64,
}

/// Splits `parent`: ranks that pass the same `color` (>= 0) form one child, ordered by `key`,
/// then by parent rank; `SYMM_SPLIT_NOCOLOR` takes part and gets `*child = NULL`. Collective:
/// every rank of the parent calls it. A color below -1 on any rank, a broken parent, or a
/// device at `SYMM_MAX_COMMS_PER_DEVICE` fails the split on every rank with an error naming the
/// rank, and the parent stays usable. The child maps no memory the parent mapped (it shares the
/// parent's peer mappings), has its own buffers, arena and error state, and keeps working after
/// the parent is destroyed. A failure while one child is made (a rank that died, memory) fails
/// the ranks of that child, naming the rank.
#[no_mangle]
pub extern "C" fn symm_comm_split(
    parent: *mut symm_comm_t,
    color: c_int,
    key: c_int,
    child: *mut *mut symm_comm_t,
) -> symm_status_t {
    guard_status!("symm_comm_split", || {
        if child.is_null() {
            return Err(Error::invalid("symm_comm_split: child is NULL"));
        }
        // SAFETY: child is non-NULL; cleared first so a failure leaves NULL.
        unsafe { child.write(std::ptr::null_mut()) };
        match with_comm(parent, |c| c.split(color, key))? {
            Some(c) => register(c, child),
            None => Ok(()),
        }
    })
}

/// `size` bytes from `comm`'s own arena of the device heap: the same offset on every rank of
/// `comm` whatever else the device holds (other communicators, other threads, device-level
/// pools), given that the ranks of `comm` make the same sequence of these calls. NULL for size
/// 0 (not an error) and on failure. Stream-ordered reuse as `symm_malloc`.
#[no_mangle]
pub extern "C" fn symm_comm_malloc(
    comm: *mut symm_comm_t,
    size: usize,
    stream: *mut CUstream_st,
) -> *mut c_void {
    guard_ptr!("symm_comm_malloc", || {
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        with_comm(comm, |c| c.comm_malloc(size as u64, stream_of(stream))).map(|p| p as *mut c_void)
    })
}

/// Frees a block of `symm_comm_malloc` of the same communicator; `size` as allocated. NULL does
/// nothing. A block of another communicator or of `symm_malloc` is refused, nothing freed.
#[no_mangle]
pub extern "C" fn symm_comm_free(
    comm: *mut symm_comm_t,
    ptr: *mut c_void,
    size: usize,
    stream: *mut CUstream_st,
) {
    guard_void!("symm_comm_free", || {
        if ptr.is_null() {
            return Ok(());
        }
        with_comm(comm, |c| {
            c.comm_free(ptr as u64, size as u64, stream_of(stream))
        })
    })
}

/// Fills the first `size` bytes of `*out` (pass `sizeof(symm_comm_info_t)`; at least the three
/// first fields, 12 bytes) with what `comm` is. Nothing past `size` is written.
#[no_mangle]
pub extern "C" fn symm_comm_info(
    comm: *mut symm_comm_t,
    out: *mut symm_comm_info_t,
    size: usize,
) -> symm_status_t {
    guard_status!("symm_comm_info", || {
        let have = std::mem::size_of::<symm_comm_info_t>();
        if out.is_null() || !(12..=have).contains(&size) || size % 4 != 0 {
            return Err(Error::invalid(format!(
                "symm_comm_info: out {out:p}, size {size}; expected a non-NULL out and a size \
                 from 12 to {have} (sizeof(symm_comm_info_t)), a multiple of 4"
            )));
        }
        let info = with_comm(comm, |c| {
            let (arena_offset, arena_bytes) = c.arena_bounds()?;
            Ok(symm_comm_info_t {
                rank: c.rank as i32,
                world_size: c.world as i32,
                device: c.device,
                comms_on_device: registry::count(c.device) as i32,
                arena_offset,
                arena_bytes,
            })
        })?;
        // SAFETY: out is non-NULL and the caller declared `size` writable bytes there (at most
        // sizeof(symm_comm_info_t), checked); the source is a live struct; distinct regions.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &info as *const symm_comm_info_t as *const u8,
                out as *mut u8,
                size,
            )
        };
        Ok(())
    })
}

/// A MemPool slot bound to `comm`'s arena (the same slot again while it is bound): torch's
/// `CUDAPluggableAllocator(libsymmalloc.so, "symm_comm_pool_malloc_<slot>", "symm_free")`
/// then allocates from the arena. After `comm` is destroyed the slot's function fails (the
/// pool can only free); `symm_mem_pool_slot_release` frees the slot once the MemPool is gone.
#[no_mangle]
pub extern "C" fn symm_comm_mem_pool_slot(
    comm: *mut symm_comm_t,
    slot: *mut c_int,
) -> symm_status_t {
    guard_status!("symm_comm_mem_pool_slot", || {
        if slot.is_null() {
            return Err(Error::invalid("symm_comm_mem_pool_slot: slot is NULL"));
        }
        let s = with_comm(comm, |c| c.mem_pool_slot())?;
        // SAFETY: slot is non-NULL and points at an int.
        unsafe { slot.write(s as c_int) };
        Ok(())
    })
}

/// Frees MemPool slot `slot` (call it when the MemPool that used it is gone).
#[no_mangle]
pub extern "C" fn symm_mem_pool_slot_release(slot: c_int) -> symm_status_t {
    guard_status!("symm_mem_pool_slot_release", || {
        let s = usize::try_from(slot).map_err(|_| {
            Error::invalid(format!(
                "MemPool slot {slot} does not exist; expected 0..{SYMM_COMM_POOL_SLOTS}"
            ))
        })?;
        registry::release_pool_slot(s)
    })
}

fn pool_malloc(slot: usize, size: usize, device: c_int, stream: *mut CUstream_st) -> *mut c_void {
    guard_ptr!("symm_comm_pool_malloc", || -> Result<*mut c_void> {
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        let pool = registry::slot_pool(slot, device)?;
        let p = heap::global()?.malloc_in(size as u64, device, stream_of(stream), pool)?;
        Ok(p as *mut c_void)
    })
}

/// One exported allocation function per MemPool slot, with symm_malloc's signature.
macro_rules! pool_slots {
    ($($name:ident = $slot:expr),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name(size: usize, device: c_int, stream: *mut CUstream_st) -> *mut c_void {
            pool_malloc($slot, size, device, stream)
        }
    )*};
}

pool_slots!(
    symm_comm_pool_malloc_0 = 0,
    symm_comm_pool_malloc_1 = 1,
    symm_comm_pool_malloc_2 = 2,
    symm_comm_pool_malloc_3 = 3,
    symm_comm_pool_malloc_4 = 4,
    symm_comm_pool_malloc_5 = 5,
    symm_comm_pool_malloc_6 = 6,
    symm_comm_pool_malloc_7 = 7,
    symm_comm_pool_malloc_8 = 8,
    symm_comm_pool_malloc_9 = 9,
    symm_comm_pool_malloc_10 = 10,
    symm_comm_pool_malloc_11 = 11,
    symm_comm_pool_malloc_12 = 12,
    symm_comm_pool_malloc_13 = 13,
    symm_comm_pool_malloc_14 = 14,
    symm_comm_pool_malloc_15 = 15,
    symm_comm_pool_malloc_16 = 16,
    symm_comm_pool_malloc_17 = 17,
    symm_comm_pool_malloc_18 = 18,
    symm_comm_pool_malloc_19 = 19,
    symm_comm_pool_malloc_20 = 20,
    symm_comm_pool_malloc_21 = 21,
    symm_comm_pool_malloc_22 = 22,
    symm_comm_pool_malloc_23 = 23,
    symm_comm_pool_malloc_24 = 24,
    symm_comm_pool_malloc_25 = 25,
    symm_comm_pool_malloc_26 = 26,
    symm_comm_pool_malloc_27 = 27,
    symm_comm_pool_malloc_28 = 28,
    symm_comm_pool_malloc_29 = 29,
    symm_comm_pool_malloc_30 = 30,
    symm_comm_pool_malloc_31 = 31,
    symm_comm_pool_malloc_32 = 32,
    symm_comm_pool_malloc_33 = 33,
    symm_comm_pool_malloc_34 = 34,
    symm_comm_pool_malloc_35 = 35,
    symm_comm_pool_malloc_36 = 36,
    symm_comm_pool_malloc_37 = 37,
    symm_comm_pool_malloc_38 = 38,
    symm_comm_pool_malloc_39 = 39,
    symm_comm_pool_malloc_40 = 40,
    symm_comm_pool_malloc_41 = 41,
    symm_comm_pool_malloc_42 = 42,
    symm_comm_pool_malloc_43 = 43,
    symm_comm_pool_malloc_44 = 44,
    symm_comm_pool_malloc_45 = 45,
    symm_comm_pool_malloc_46 = 46,
    symm_comm_pool_malloc_47 = 47,
    symm_comm_pool_malloc_48 = 48,
    symm_comm_pool_malloc_49 = 49,
    symm_comm_pool_malloc_50 = 50,
    symm_comm_pool_malloc_51 = 51,
    symm_comm_pool_malloc_52 = 52,
    symm_comm_pool_malloc_53 = 53,
    symm_comm_pool_malloc_54 = 54,
    symm_comm_pool_malloc_55 = 55,
    symm_comm_pool_malloc_56 = 56,
    symm_comm_pool_malloc_57 = 57,
    symm_comm_pool_malloc_58 = 58,
    symm_comm_pool_malloc_59 = 59,
    symm_comm_pool_malloc_60 = 60,
    symm_comm_pool_malloc_61 = 61,
    symm_comm_pool_malloc_62 = 62,
    symm_comm_pool_malloc_63 = 63,
);

const _: () = assert!(
    registry::POOL_SLOTS == 64,
    "one symm_comm_pool_malloc_<k> per slot"
);
