//! Bad input through the C ABI (host backend): every case gives a clear error through
//! symm_last_error() and leaves every other allocation intact and usable.

mod common;
use common::{destroy, err};
use std::ffi::CStr;
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn host() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: set before any other thread of this test binary touches the library (every
    // test calls host() first, and Once serialises them).
    ONCE.call_once(|| unsafe { std::env::set_var("SYMMALLOC_BACKEND", "host") });
}

struct Witness {
    ptr: *mut u8,
    size: usize,
    device: i32,
}

impl Witness {
    fn new(device: i32) -> Self {
        let size = 8192;
        let ptr = symm_malloc(size, device, null_mut()) as *mut u8;
        assert!(!ptr.is_null(), "{}", err());
        // SAFETY: fresh block of `size` bytes of host memory.
        unsafe { std::ptr::write_bytes(ptr, 0xA5, size) };
        Witness { ptr, size, device }
    }
    fn intact(&self) {
        // SAFETY: the block is live.
        let s = unsafe { std::slice::from_raw_parts(self.ptr, self.size) };
        assert!(
            s.iter().all(|&b| b == 0xA5),
            "a bad call disturbed another allocation"
        );
    }
}

impl Drop for Witness {
    fn drop(&mut self) {
        self.intact();
        symm_free(self.ptr as *mut _, self.size, self.device, null_mut());
        assert_eq!(err(), "");
    }
}

#[test]
fn invalid_device() {
    host();
    let w = Witness::new(0);
    assert!(symm_malloc(64, 99, null_mut()).is_null());
    let e = err();
    assert!(
        e.contains("SYMM_ERR_INVALID_ARGUMENT") && e.contains("device 99"),
        "{e}"
    );
    assert!(symm_malloc(64, -1, null_mut()).is_null());
    assert!(err().contains("device -1"));
    let mut s = std::mem::MaybeUninit::uninit();
    assert_eq!(
        symm_memory_stats(8, s.as_mut_ptr()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    w.intact();
}

#[test]
fn absurd_sizes() {
    host();
    let w = Witness::new(1);
    assert!(symm_malloc(usize::MAX, 1, null_mut()).is_null());
    let e = err();
    assert!(
        e.contains("exceeds the heap") && e.contains(&usize::MAX.to_string()),
        "{e}"
    );
    // "Negative" sizes from C arrive as huge size_t values.
    assert!(symm_malloc((-4096isize) as usize, 1, null_mut()).is_null());
    assert!(err().contains("exceeds the heap"));
    assert!(symm_malloc(0, 1, null_mut()).is_null());
    assert_eq!(err(), "", "size 0 returns NULL and is not an error");
    w.intact();
}

#[test]
fn foreign_double_and_mismatched_frees() {
    host();
    let w = Witness::new(2);
    let mut local = [0u8; 64];
    symm_free(local.as_mut_ptr() as *mut _, 64, 2, null_mut());
    assert!(err().contains("not returned by symm_malloc"), "{}", err());
    let p = symm_malloc(1000, 2, null_mut());
    symm_free(p, 999, 2, null_mut());
    let e = err();
    assert!(
        e.contains("size=999") && e.contains("allocated with size 1000"),
        "{e}"
    );
    symm_free(p, 1000, 3, null_mut());
    assert!(err().contains("belongs to device 2"), "{}", err());
    // Still live after the failed frees: free it properly, then twice.
    symm_free(p, 1000, 2, null_mut());
    assert_eq!(err(), "");
    symm_free(p, 1000, 2, null_mut());
    assert!(err().contains("double free"), "{}", err());
    // Interior pointer.
    let q = symm_malloc(4096, 2, null_mut()) as *mut u8;
    // SAFETY: pointer arithmetic inside the block; never dereferenced.
    symm_free(unsafe { q.add(16) } as *mut _, 4096, 2, null_mut());
    assert!(err().contains("not returned by symm_malloc"), "{}", err());
    symm_free(q as *mut _, 4096, 2, null_mut());
    assert_eq!(err(), "");
    symm_record_stream(local.as_mut_ptr() as *mut _, null_mut());
    assert!(err().contains("not returned by symm_malloc"));
    symm_free(null_mut(), 0, 2, null_mut());
    assert_eq!(err(), "", "free(NULL) is a no-op");
    w.intact();
}

#[test]
fn mismatched_pools() {
    host();
    let w = Witness::new(3);
    symm_end_pool(3, 1, 2);
    assert!(err().contains("no pool is open"), "{}", err());
    symm_begin_pool(3, 1, 2);
    symm_begin_pool(3, 3, 4);
    symm_end_pool(3, 1, 2);
    let e = err();
    assert!(e.contains("innermost pool") && e.contains("(3, 4)"), "{e}");
    symm_end_pool(3, 3, 4);
    symm_end_pool(3, 1, 2);
    assert_eq!(err(), "");
    symm_begin_pool(3, u64::MAX, u64::MAX);
    assert!(err().contains("reserved"), "{}", err());
    symm_release_pool(3, u64::MAX, u64::MAX);
    assert!(err().contains("not releasable"), "{}", err());
    w.intact();
}

#[test]
fn comm_bad_input() {
    host();
    let w = Witness::new(4);
    let mut id = symm_unique_id_t { internal: [0; 128] };
    assert_eq!(symm_get_unique_id(&mut id), symm_status_t::SYMM_SUCCESS);
    let mut comm: *mut symm_comm_t = null_mut();
    assert_eq!(
        symm_comm_init(null_mut(), 1, 0, 4, &id),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_comm_init(&mut comm, 1, 0, 4, std::ptr::null()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_comm_init(&mut comm, 2, 2, 4, &id),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("rank 2 is out of range"), "{}", err());
    assert_eq!(
        symm_comm_init(&mut comm, 9, 0, 4, &id),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("world_size 9"), "{}", err());
    let garbage = symm_unique_id_t {
        internal: [0x33; 128],
    };
    assert_eq!(
        symm_comm_init(&mut comm, 1, 0, 4, &garbage),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("magic"), "{}", err());
    assert!(comm.is_null());
    // A real single-rank communicator: a second one on the same device (several live
    // communicators per device), bad collective args, destroy twice.
    assert_eq!(
        symm_comm_init(&mut comm, 1, 0, 4, &id),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
    let mut id2 = id;
    assert_eq!(symm_get_unique_id(&mut id2), symm_status_t::SYMM_SUCCESS);
    let mut again: *mut symm_comm_t = null_mut();
    assert_eq!(
        symm_comm_init(&mut again, 1, 0, 4, &id2),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
    assert_eq!(symm_comm_destroy(again), symm_status_t::SYMM_SUCCESS);
    let buf = symm_malloc(4096, 4, null_mut());
    assert_eq!(
        symm_all_reduce(comm, buf, buf, 16, 7, SYMM_SUM, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("dtype 7"));
    assert_eq!(
        symm_all_reduce(comm, buf, buf, 16, SYMM_FP32, 9, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_all_reduce_algo(comm, 5, buf, buf, 16, SYMM_FP32, SYMM_SUM, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_all_reduce(
            comm,
            std::ptr::null(),
            buf,
            16,
            SYMM_FP32,
            SYMM_SUM,
            null_mut()
        ),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_all_reduce(comm, buf, buf, 2048, SYMM_FP32, SYMM_SUM, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("runs past the end"), "{}", err());
    assert_eq!(
        symm_all_reduce_algo(
            comm,
            SYMM_ALGO_MULTIMEM,
            buf,
            buf,
            16,
            SYMM_FP32,
            SYMM_SUM,
            null_mut()
        ),
        symm_status_t::SYMM_ERR_UNSUPPORTED
    );
    assert!(err().contains("multicast"), "{}", err());
    // The LL kernel's capacity is checked before anything else about the buffers.
    assert_eq!(
        symm_all_reduce_algo(
            comm,
            SYMM_ALGO_ONE_SHOT_LL,
            buf,
            buf,
            (1 << 20) + 1,
            SYMM_FP32,
            SYMM_SUM,
            null_mut()
        ),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(
        err().contains("ONE_SHOT_LL takes messages up to 4194304 bytes"),
        "{}",
        err()
    );
    // Single rank: the all-reduce is a copy.
    // SAFETY: buf holds 4096 bytes of host memory.
    let v = unsafe { std::slice::from_raw_parts_mut(buf as *mut f32, 16) };
    v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
    assert_eq!(
        symm_all_reduce(comm, buf, buf, 16, SYMM_FP32, SYMM_SUM, null_mut()),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
    assert_eq!(
        symm_barrier(comm, null_mut()),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
    symm_free(buf, 4096, 4, null_mut());
    destroy(comm);
    assert_eq!(
        symm_comm_destroy(comm),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("destroyed twice"), "{}", err());
    assert_eq!(
        symm_all_reduce(comm, buf, buf, 1, SYMM_FP32, SYMM_SUM, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_comm_destroy(null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    w.intact();
}

#[test]
fn status_strings() {
    // SAFETY: symm_status_string returns static C strings.
    let s = |st| {
        unsafe { CStr::from_ptr(symm_status_string(st)) }
            .to_string_lossy()
            .into_owned()
    };
    assert!(s(symm_status_t::SYMM_SUCCESS).starts_with("SYMM_SUCCESS"));
    assert!(s(symm_status_t::SYMM_ERR_NOT_SYMMETRIC).starts_with("SYMM_ERR_NOT_SYMMETRIC"));
}

/// Frees from a thread-local destructor that runs after symmalloc's own thread-locals are
/// destroyed (PyTorch frees tensors this way at exit): must neither panic nor abort.
#[test]
fn free_during_thread_local_teardown() {
    host();
    struct FreeOnDrop(usize);
    impl Drop for FreeOnDrop {
        fn drop(&mut self) {
            if self.0 != 0 {
                symm_free(self.0 as *mut _, 4096, 5, null_mut());
                let p = symm_malloc(64, 5, null_mut());
                symm_free(p, 64, 5, null_mut());
                let _ = symm_last_error();
            }
        }
    }
    thread_local! {
        static HOLDER: std::cell::RefCell<FreeOnDrop> = const { std::cell::RefCell::new(FreeOnDrop(0)) };
    }
    std::thread::spawn(|| {
        // Touch ours first: destructors run in reverse order of registration, so symmalloc's
        // thread-locals (first used below) are torn down before HOLDER.
        HOLDER.with(|_| {});
        let p = symm_malloc(4096, 5, null_mut()) as usize;
        assert_ne!(p, 0, "{}", err());
        HOLDER.with(|h| h.borrow_mut().0 = p);
    })
    .join()
    .expect("the thread must exit cleanly");
    let mut s = std::mem::MaybeUninit::uninit();
    assert_eq!(
        symm_memory_stats(5, s.as_mut_ptr()),
        symm_status_t::SYMM_SUCCESS
    );
    // SAFETY: filled on success.
    assert_eq!(
        unsafe { s.assume_init() }.active_blocks,
        0,
        "the exit-path free went through"
    );
}
