//! A word of shared memory that the kernel itself changes when this process exits or replaces its image.
//!
//! The mechanism is the robust-futex list (`set_robust_list(2)`): when a thread ends, the kernel walks the
//! list the thread registered and, in every listed word that still holds the thread's id, replaces the id
//! with `FUTEX_OWNER_DIED`. A dedicated thread ("gixl-sentinel") stores its id in the word and lists the
//! word on a robust list of its own. It ends only when [`Sentinel`] is dropped (which restores the list
//! first, so the kernel never touches the word), or when the process does: on exit or kill, and on
//! `execve` by any thread, which first ends every other thread and then releases the exec'ing thread's list,
//! all before the old address space is dropped. A process that maps the same memory can thus tell, with
//! one load, whether the process that published the word still runs the same image:
//!
//! - `0`: no sentinel (an older peer, or the thread could not start): use another check;
//! - the owner's thread id: alive, same image;
//! - anything else (`FUTEX_OWNER_DIED`, maybe with the waiters bit): exited or exec'd, for good.
//!
//! Why it is exact for reading another process's memory: `process_vm_readv` resolves the pid to one address
//! space when the call starts. If that address space was an exec'd image or another process that took over
//! the pid, the word was flipped before that address space could be found by the pid, so reading the word
//! after the call and finding it unchanged proves the data came from the original image. (It cannot guard a
//! write: the bytes would already be in the new image. Writes keep the gate probe, see `copy::cma_batch`.)
//!
//! The thread's own glibc robust list is set aside while it runs and restored before it returns; the thread
//! never takes a process-shared robust pthread mutex in between.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

/// Set by the kernel in a robust futex word whose owner thread ended.
pub const OWNER_DIED: u32 = 0x4000_0000;
const TID_MASK: u32 = 0x3fff_ffff;

/// What a sentinel word says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Word {
    /// The publisher has no sentinel.
    Absent,
    /// Alive and running the same image; the value to compare later reads with.
    Alive(u32),
    /// Exited, killed or exec'd.
    Ended,
}

pub fn read(w: &AtomicU32) -> Word {
    match w.load(Ordering::SeqCst) {
        0 => Word::Absent,
        v if v & !TID_MASK == 0 => Word::Alive(v),
        _ => Word::Ended,
    }
}

#[repr(C)]
struct RobustList {
    next: *mut RobustList,
}

/// The kernel's `struct robust_list_head`.
#[repr(C)]
struct RobustHead {
    list: RobustList,
    futex_offset: libc::c_long,
    list_op_pending: *mut RobustList,
}

/// The running sentinel thread of one word; dropping it ends the thread without flipping the word to "ended"
/// by the kernel (the word is set to `OWNER_DIED` by the thread itself: the publisher is going away anyway).
pub struct Sentinel {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Sentinel {
    /// Start the thread that owns `word`; returns once the word holds its id.
    ///
    /// # Safety
    /// `word` must point at a 4-byte aligned word of a shared mapping that stays mapped until the returned
    /// value is dropped.
    pub unsafe fn start(word: *const AtomicU32) -> io::Result<Sentinel> {
        let addr = word as usize;
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let stop2 = stop.clone();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("gixl-sentinel".into())
            .stack_size(64 << 10)
            .spawn(move || run(addr, &stop2, ready_tx))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Sentinel { stop, thread: Some(thread) }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(io::Error::other("the sentinel thread ended before it started"))
            }
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(addr: usize, stop: &(Mutex<bool>, Condvar), ready: mpsc::Sender<io::Result<()>>) {
    // SAFETY: the caller of `start` keeps the word mapped until this thread has been joined.
    let word = unsafe { &*(addr as *const AtomicU32) };
    let mut old_head: *mut libc::c_void = std::ptr::null_mut();
    let mut old_len: libc::size_t = 0;
    // SAFETY: out-pointers to locals; pid 0 is this thread.
    if unsafe { libc::syscall(libc::SYS_get_robust_list, 0, &mut old_head, &mut old_len) } != 0 {
        let _ = ready.send(Err(io::Error::last_os_error()));
        return;
    }
    // The list: head -> entry -> head. Heap-allocated so they never move while registered.
    let mut entry = Box::new(RobustList { next: std::ptr::null_mut() });
    let entry_ptr: *mut RobustList = &mut *entry;
    let mut head = Box::new(RobustHead {
        list: RobustList { next: entry_ptr },
        futex_offset: (addr as isize).wrapping_sub(entry_ptr as isize) as libc::c_long,
        list_op_pending: std::ptr::null_mut(),
    });
    entry.next = &mut head.list;
    let head_ptr: *mut RobustHead = &mut *head;
    // SAFETY: a well-formed list that outlives its registration (restored below before both boxes drop).
    if unsafe { libc::syscall(libc::SYS_set_robust_list, head_ptr, std::mem::size_of::<RobustHead>()) } != 0 {
        let _ = ready.send(Err(io::Error::last_os_error()));
        return;
    }
    // SAFETY: plain syscall.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
    word.store(tid & TID_MASK, Ordering::SeqCst);
    let _ = ready.send(Ok(()));
    let mut stopped = stop.0.lock();
    while !*stopped {
        stop.1.wait(&mut stopped);
    }
    drop(stopped);
    word.store(OWNER_DIED, Ordering::SeqCst);
    // SAFETY: restoring exactly what the thread had (glibc's own head), before our list is freed.
    unsafe { libc::syscall(libc::SYS_set_robust_list, old_head, old_len) };
    drop(head);
    drop(entry);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared_word() -> *mut AtomicU32 {
        // SAFETY: an anonymous shared mapping of one page, checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast()
    }

    #[test]
    fn alive_while_running_and_ended_after_drop() {
        let w = shared_word();
        // SAFETY: the mapping is never unmapped in this test.
        let s = unsafe { Sentinel::start(w) }.unwrap();
        let word = unsafe { &*w };
        assert!(matches!(read(word), Word::Alive(_)), "{:#x}", word.load(Ordering::SeqCst));
        drop(s);
        assert_eq!(read(word), Word::Ended);
    }

    /// The kernel flips the word when the process that owns it exits, and when it execs: a forked child
    /// starts a sentinel on a shared page, then exits, or execs `sleep` (still running while we look).
    #[test]
    fn the_kernel_flips_it_on_exit_and_on_exec() {
        for exec in [false, true] {
            let w = shared_word();
            // SAFETY: the mapping is never unmapped in this test.
            let (word, flag) = unsafe { (&*w, &*w.add(1)) };
            let (path, arg) = (c"/bin/sleep", c"30");
            let argv = [path.as_ptr(), arg.as_ptr(), std::ptr::null()];
            // SAFETY: the child only starts a thread, then exits or execs; the parent waits for it.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0);
            if pid == 0 {
                // SAFETY: as above; the child never returns into the test harness.
                unsafe {
                    match Sentinel::start(w) {
                        Ok(s) => std::mem::forget(s),
                        Err(_) => libc::_exit(3),
                    }
                    // Wait until the parent has seen the word alive (it sets the word's neighbour).
                    while flag.load(Ordering::SeqCst) == 0 {
                        libc::usleep(1000);
                    }
                    if exec {
                        libc::execv(path.as_ptr(), argv.as_ptr());
                    }
                    libc::_exit(0);
                }
            }
            let t0 = std::time::Instant::now();
            while !matches!(read(word), Word::Alive(_)) {
                assert!(t0.elapsed().as_secs() < 10, "the child's sentinel never started");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            flag.store(1, Ordering::SeqCst);
            let mut status = 0;
            if exec {
                while read(word) != Word::Ended {
                    assert!(
                        t0.elapsed().as_secs() < 10,
                        "exec did not flip the word: {:#x}",
                        word.load(Ordering::SeqCst)
                    );
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                // SAFETY: our child.
                assert_eq!(unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) }, 0, "the exec'd child is running");
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            // SAFETY: our child.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            if !exec {
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
            }
            assert_eq!(read(word), Word::Ended, "exec = {exec}: {:#x}", word.load(Ordering::SeqCst));
        }
    }
}
