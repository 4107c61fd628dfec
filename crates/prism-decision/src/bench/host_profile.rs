//! `prism bench --host-profile FILE`: a sampling profile of the host's CPU time (Linux on x86_64), for
//! passes whose host work (enqueueing kernels) bounds them. While a window is open, about every
//! millisecond of the process's CPU time (`ITIMER_PROF`; the kernel's timer tick may make it coarser)
//! the thread that used it records the instruction it was interrupted at and, in a build with frame
//! pointers (`RUSTFLAGS="-C force-frame-pointers=yes"`), the return addresses of the frames above it.
//! The file holds those samples with `/proc/self/maps`; `tools/host_profile.py` names the functions from
//! the unstripped binary of the same build (the device runs a stripped copy). Code without frame pointers
//! (the CUDA driver) ends a walk early or, where it leaves the caller's frame pointer in place, is passed
//! through to its Rust callers.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The most samples a run keeps (8 · (3 + FRAMES) bytes each); later ones are counted as dropped.
const CAPACITY: usize = 1 << 17;
/// The most frames a sample keeps: the interrupted instruction, then return addresses.
const FRAMES: usize = 32;

/// One sample: its window's tag, the thread, the interrupted instruction and the return addresses
/// of the frames above it (innermost first; just the instruction without frame pointers).
pub struct Sample {
    pub tag: u64,
    pub thread: u64,
    pub stack: Vec<u64>,
}

/// An open profile: the signal handler and timer are installed from [`HostProfile::start`] to
/// [`HostProfile::finish`]; samples are kept only between [`HostProfile::open`] and [`HostProfile::close`].
pub struct HostProfile {
    path: PathBuf,
    tags: Vec<String>,
}

impl HostProfile {
    /// Installs the sampler (idle until a window opens); `path` is written by [`HostProfile::finish`].
    pub fn start(path: &Path) -> Result<Self> {
        imp::install()?;
        Ok(Self {
            path: path.to_path_buf(),
            tags: Vec::new(),
        })
    }

    /// Turns sampling on, the samples tagged `tag`, until [`HostProfile::close`].
    pub fn open(&mut self, tag: &str) {
        let index = match self.tags.iter().position(|t| t == tag) {
            Some(i) => i,
            None => {
                self.tags.push(tag.to_string());
                self.tags.len() - 1
            }
        };
        imp::set_active(Some(index as u64));
    }

    /// Turns sampling off.
    pub fn close(&self) {
        imp::set_active(None);
    }

    /// Stops the sampler and writes the file: the tags, the process's memory map and the samples.
    pub fn finish(self) -> Result<()> {
        let (samples, dropped) = imp::uninstall()?;
        let maps = std::fs::read_to_string("/proc/self/maps").context("reading /proc/self/maps")?;
        let file = std::fs::File::create(&self.path)
            .with_context(|| format!("creating {}", self.path.display()))?;
        let mut out = std::io::BufWriter::new(file);
        writeln!(
            out,
            "# prism host profile 1: a sample about every ms of process CPU time"
        )?;
        writeln!(out, "# dropped {dropped}")?;
        for (i, tag) in self.tags.iter().enumerate() {
            writeln!(out, "tag {i} {tag}")?;
        }
        for line in maps.lines() {
            writeln!(out, "map {line}")?;
        }
        for sample in samples {
            write!(out, "s {} {}", sample.tag, sample.thread)?;
            for address in &sample.stack {
                write!(out, " {address:x}")?;
            }
            writeln!(out)?;
        }
        out.flush()
            .with_context(|| format!("writing {}", self.path.display()))?;
        Ok(())
    }
}

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod imp {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use std::sync::OnceLock;

    use anyhow::{bail, Result};

    use super::{Sample, CAPACITY, FRAMES};

    /// Words a sample: tag, thread, frame count, then the interrupted instruction and up to
    /// FRAMES − 1 return addresses.
    const WORDS: usize = 3 + FRAMES;

    static SAMPLES: OnceLock<Box<[AtomicU64]>> = OnceLock::new();
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    static ACTIVE: AtomicBool = AtomicBool::new(false);
    static TAG: AtomicU64 = AtomicU64::new(0);
    static INSTALLED: AtomicBool = AtomicBool::new(false);

    /// Reads the two words at `fp` (the saved frame pointer and the return address) through
    /// process_vm_readv, which fails with EFAULT on an unmapped address instead of faulting, so a
    /// register that is not a frame pointer (code built without them, e.g. the CUDA driver) only ends
    /// the walk.
    fn read_frame(fp: u64) -> Option<(u64, u64)> {
        let mut words = [0u64; 2];
        let local = libc::iovec {
            iov_base: words.as_mut_ptr().cast(),
            iov_len: 16,
        };
        let remote = libc::iovec {
            iov_base: fp as *mut libc::c_void,
            iov_len: 16,
        };
        // SAFETY: the local buffer holds 16 bytes; the remote range is only read by the kernel, which
        // checks it.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        (n == 16).then_some((words[0], words[1]))
    }

    /// The SIGPROF handler: async-signal-safe (atomics, reads of the interrupted context, gettid,
    /// getpid, process_vm_readv).
    extern "C" fn on_sigprof(_: libc::c_int, _: *mut libc::siginfo_t, context: *mut libc::c_void) {
        if !ACTIVE.load(Ordering::Relaxed) || context.is_null() {
            return;
        }
        let Some(buf) = SAMPLES.get() else { return };
        // SAFETY: with SA_SIGINFO the third argument is the interrupted thread's ucontext_t.
        let (ip, mut fp, sp) = unsafe {
            let regs = &(*(context as *const libc::ucontext_t)).uc_mcontext.gregs;
            (
                regs[libc::REG_RIP as usize] as u64,
                regs[libc::REG_RBP as usize] as u64,
                regs[libc::REG_RSP as usize] as u64,
            )
        };
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        if (i + 1) * WORDS > buf.len() {
            return;
        }
        let at = &buf[i * WORDS..(i + 1) * WORDS];
        // SAFETY: gettid takes no arguments and cannot fail.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u64;
        at[0].store(TAG.load(Ordering::Relaxed), Ordering::Relaxed);
        at[1].store(tid, Ordering::Relaxed);
        at[3].store(ip, Ordering::Relaxed);
        // Frame pointers (binaries built with -C force-frame-pointers=yes): each frame above the
        // stack pointer, 16-byte aligned, below the next one and within 8 MiB of the stack pointer.
        let mut frames = 1;
        while frames < FRAMES && fp > sp && fp % 16 == 0 && fp - sp < 8 << 20 {
            let Some((next, ret)) = read_frame(fp) else {
                break;
            };
            if ret == 0 {
                break;
            }
            at[3 + frames].store(ret, Ordering::Relaxed);
            frames += 1;
            if next <= fp {
                break;
            }
            fp = next;
        }
        at[2].store(frames as u64, Ordering::Relaxed);
    }

    pub fn install() -> Result<()> {
        if INSTALLED.swap(true, Ordering::SeqCst) {
            bail!("a host profile is already running in this process");
        }
        SAMPLES.get_or_init(|| (0..WORDS * CAPACITY).map(|_| AtomicU64::new(0)).collect());
        NEXT.store(0, Ordering::SeqCst);
        // SAFETY: a zeroed sigaction with a valid handler, SA_SIGINFO | SA_RESTART (interrupted system
        // calls restart); the timer fires SIGPROF every millisecond of the process's CPU time.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigprof as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(libc::SIGPROF, &action, std::ptr::null_mut()) != 0 {
                bail!(
                    "installing the SIGPROF handler: {}",
                    std::io::Error::last_os_error()
                );
            }
            let tick = libc::timeval {
                tv_sec: 0,
                tv_usec: 1000,
            };
            let timer = libc::itimerval {
                it_interval: tick,
                it_value: tick,
            };
            if libc::setitimer(libc::ITIMER_PROF, &timer, std::ptr::null_mut()) != 0 {
                bail!(
                    "starting the profiling timer: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
        Ok(())
    }

    pub fn set_active(tag: Option<u64>) {
        if let Some(t) = tag {
            TAG.store(t, Ordering::SeqCst);
        }
        ACTIVE.store(tag.is_some(), Ordering::SeqCst);
    }

    /// Stops the timer, ignores SIGPROF from then on and returns the samples and how many did not fit.
    pub fn uninstall() -> Result<(Vec<Sample>, usize)> {
        ACTIVE.store(false, Ordering::SeqCst);
        // SAFETY: a zero timer stops it; SIG_IGN then drops a SIGPROF still pending.
        unsafe {
            let zero = std::mem::zeroed::<libc::itimerval>();
            libc::setitimer(libc::ITIMER_PROF, &zero, std::ptr::null_mut());
            libc::signal(libc::SIGPROF, libc::SIG_IGN);
        }
        INSTALLED.store(false, Ordering::SeqCst);
        let taken = NEXT.swap(0, Ordering::SeqCst);
        let Some(buf) = SAMPLES.get() else {
            return Ok((Vec::new(), 0));
        };
        let kept = taken.min(buf.len() / WORDS);
        let samples = (0..kept)
            .filter_map(|i| {
                let at = &buf[i * WORDS..(i + 1) * WORDS];
                let frames = (at[2].load(Ordering::Relaxed) as usize).min(FRAMES);
                let stack: Vec<u64> = at[3..3 + frames]
                    .iter()
                    .map(|w| w.load(Ordering::Relaxed))
                    .collect();
                (frames > 0 && stack[0] != 0).then(|| Sample {
                    tag: at[0].load(Ordering::Relaxed),
                    thread: at[1].load(Ordering::Relaxed),
                    stack,
                })
            })
            .collect();
        Ok((samples, taken - kept))
    }
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
mod imp {
    use anyhow::{bail, Result};

    pub fn install() -> Result<()> {
        bail!("--host-profile needs Linux on x86_64")
    }
    pub fn set_active(_: Option<u64>) {}
    pub fn uninstall() -> Result<(Vec<super::Sample>, usize)> {
        Ok((Vec::new(), 0))
    }
}

/// Fails unless `path`'s folder exists (checked before a long load, not after it).
pub fn check_writable(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        bail!(
            "--host-profile {}: no folder {}",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}
