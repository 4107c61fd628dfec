//! `prism bench --host-profile FILE`: a sampling profile of the host's CPU time (Linux on x86_64), for
//! passes whose host work (enqueueing kernels) bounds them. While a window is open, every millisecond
//! of the process's CPU time (`ITIMER_PROF`; the kernel's timer tick may make it coarser) the thread
//! that used it records the instruction it was interrupted at; the file holds those samples with `/proc/self/maps`, and `tools/host_profile.py`
//! names the functions from the unstripped binary of the same build (the device runs a stripped copy).
//! Samples are leaf addresses only (no call stacks): time inside the CUDA driver shows as the driver.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The most samples a run keeps (16 bytes each); later ones are counted as dropped.
const CAPACITY: usize = 1 << 21;

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
        for (tag, tid, ip) in samples {
            writeln!(out, "s {tag} {tid} {ip:x}")?;
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

    use super::CAPACITY;

    /// A sample: tag, thread, instruction pointer.
    pub type Sample = (u64, u64, u64);

    /// Three words a sample (tag, thread, instruction pointer), written by the signal handler.
    static SAMPLES: OnceLock<Box<[AtomicU64]>> = OnceLock::new();
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    static ACTIVE: AtomicBool = AtomicBool::new(false);
    static TAG: AtomicU64 = AtomicU64::new(0);
    static INSTALLED: AtomicBool = AtomicBool::new(false);

    /// The SIGPROF handler: async-signal-safe (atomics, a read of the interrupted context, gettid).
    extern "C" fn on_sigprof(_: libc::c_int, _: *mut libc::siginfo_t, context: *mut libc::c_void) {
        if !ACTIVE.load(Ordering::Relaxed) || context.is_null() {
            return;
        }
        let Some(buf) = SAMPLES.get() else { return };
        // SAFETY: with SA_SIGINFO the third argument is the interrupted thread's ucontext_t.
        let ip = unsafe {
            (*(context as *const libc::ucontext_t)).uc_mcontext.gregs[libc::REG_RIP as usize]
        } as u64;
        // SAFETY: gettid takes no arguments and cannot fail.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u64;
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        if 3 * i + 2 < buf.len() {
            buf[3 * i].store(TAG.load(Ordering::Relaxed), Ordering::Relaxed);
            buf[3 * i + 1].store(tid, Ordering::Relaxed);
            buf[3 * i + 2].store(ip, Ordering::Relaxed);
        }
    }

    pub fn install() -> Result<()> {
        if INSTALLED.swap(true, Ordering::SeqCst) {
            bail!("a host profile is already running in this process");
        }
        SAMPLES.get_or_init(|| (0..3 * CAPACITY).map(|_| AtomicU64::new(0)).collect());
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

    /// Stops the timer, restores SIGPROF's default action and returns the samples and how many did
    /// not fit.
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
        let kept = taken.min(buf.len() / 3);
        let samples = (0..kept)
            .map(|i| {
                (
                    buf[3 * i].load(Ordering::Relaxed),
                    buf[3 * i + 1].load(Ordering::Relaxed),
                    buf[3 * i + 2].load(Ordering::Relaxed),
                )
            })
            .filter(|&(_, _, ip)| ip != 0)
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
    pub fn uninstall() -> Result<(Vec<(u64, u64, u64)>, usize)> {
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
