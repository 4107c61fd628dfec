//! An opt-in section profiler (`prism bench --profile sync|events`). Off (the default), a section costs
//! one relaxed atomic load.
//!
//! - [`Mode::Sync`]: [`time`] synchronizes the device before and after a section and adds the elapsed
//!   wall time to a global table. The synchronizations serialize the host and the device, so a profiled
//!   run is slower than a plain one: the table says where device time goes, not the latency of an
//!   unprofiled run.
//! - [`Mode::Events`]: nothing is synchronized. A section records a CUDA event on the device's stream
//!   at its start and at its end, and measures the host time spent enqueueing it; [`take`]
//!   synchronizes once and reads the events. A section's device span is the stream's time between
//!   its two events: where the host enqueues more slowly than the device runs, the span holds the
//!   device's idle wait for the host, and span ≈ host time. Where the device is the bottleneck, the
//!   span is the section's device time and exceeds its host time. Each event costs the host about a
//!   microsecond, which the host times include. On the CPU both times are the host's.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::Device;

/// What the profiler does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Nothing (the default).
    Off,
    /// Device synchronizations around every section.
    Sync,
    /// CUDA events around every section, no synchronization.
    Events,
}

impl Mode {
    /// The mode's name, as `prism bench --profile` takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Sync => "sync",
            Mode::Events => "events",
        }
    }
}

/// 0: off, 1: sync, 2: events.
static STATE: AtomicU8 = AtomicU8::new(0);

/// One section's totals since the last [`take`].
#[derive(Debug, Clone, PartialEq)]
pub struct SectionTime {
    pub name: &'static str,
    /// The device's time: between synchronizations ([`Mode::Sync`]) or between the section's events
    /// ([`Mode::Events`]; the host's time where there are no events).
    pub device: Duration,
    /// The host's time inside the section (with [`Mode::Sync`], the same as `device`).
    pub host: Duration,
    pub calls: u64,
}

/// A section measured in events mode whose device time is read at [`take`].
struct Pending {
    name: &'static str,
    host: Duration,
    #[cfg(feature = "cuda")]
    events: Option<(
        candle_core::cuda_backend::cudarc::driver::CudaEvent,
        candle_core::cuda_backend::cudarc::driver::CudaEvent,
    )>,
}

static TABLE: Mutex<Vec<SectionTime>> = Mutex::new(Vec::new());
static PENDING: Mutex<Vec<Pending>> = Mutex::new(Vec::new());

/// The profiler's mode.
pub fn mode() -> Mode {
    match STATE.load(Ordering::Relaxed) {
        1 => Mode::Sync,
        2 => Mode::Events,
        _ => Mode::Off,
    }
}

/// Whether profiling is on (either mode).
pub fn enabled() -> bool {
    mode() != Mode::Off
}

/// Sets the profiler's mode for the whole process.
pub fn set_mode(mode: Mode) {
    let v = match mode {
        Mode::Off => 0,
        Mode::Sync => 1,
        Mode::Events => 2,
    };
    STATE.store(v, Ordering::Relaxed);
}

/// Turns profiling on (synchronized) or off for the whole process.
pub fn set_enabled(on: bool) {
    set_mode(if on { Mode::Sync } else { Mode::Off });
}

/// Runs `f` as section `name`, timed as the mode says.
pub fn time<T, E: From<candle_core::Error>>(
    name: &'static str,
    device: &Device,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    if !enabled() {
        return f();
    }
    let section = Section::start(name, device)?;
    let out = f()?;
    section.stop()?;
    Ok(out)
}

/// A section timed from [`Section::start`] to [`Section::stop`] (for code that cannot be a closure).
pub struct Section {
    name: &'static str,
    device: Device,
    mode: Mode,
    start: Option<Instant>,
    #[cfg(feature = "cuda")]
    event: Option<candle_core::cuda_backend::cudarc::driver::CudaEvent>,
}

#[cfg(feature = "cuda")]
fn record(
    device: &Device,
) -> candle_core::Result<Option<candle_core::cuda_backend::cudarc::driver::CudaEvent>> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    match device {
        Device::Cuda(dev) => dev
            .cuda_stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map(Some)
            .map_err(|e| candle_core::Error::Msg(format!("profile: recording a CUDA event: {e}"))),
        _ => Ok(None),
    }
}

impl Section {
    pub fn start(name: &'static str, device: &Device) -> candle_core::Result<Self> {
        let mode = mode();
        if mode == Mode::Sync {
            device.synchronize()?;
        }
        #[cfg(feature = "cuda")]
        let event = if mode == Mode::Events {
            record(device)?
        } else {
            None
        };
        Ok(Self {
            name,
            device: device.clone(),
            mode,
            start: (mode != Mode::Off).then(Instant::now),
            #[cfg(feature = "cuda")]
            event,
        })
    }

    pub fn stop(self) -> candle_core::Result<()> {
        let Some(start) = self.start else {
            return Ok(());
        };
        match self.mode {
            Mode::Off => {}
            Mode::Sync => {
                self.device.synchronize()?;
                let t = start.elapsed();
                add(self.name, t, t, 1);
            }
            Mode::Events => {
                #[cfg(feature = "cuda")]
                let events = match self.event {
                    Some(begin) => record(&self.device)?.map(|end| (begin, end)),
                    None => None,
                };
                let host = start.elapsed();
                PENDING
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Pending {
                        name: self.name,
                        host,
                        #[cfg(feature = "cuda")]
                        events,
                    });
            }
        }
        Ok(())
    }
}

fn add(name: &'static str, device: Duration, host: Duration, calls: u64) {
    let mut table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    match table.iter_mut().find(|s| s.name == name) {
        Some(entry) => {
            entry.device += device;
            entry.host += host;
            entry.calls += calls;
        }
        None => table.push(SectionTime {
            name,
            device,
            host,
            calls,
        }),
    }
}

/// The sections timed since the last call, in first-seen order. Reads the pending events of
/// [`Mode::Events`] (which waits for the device to reach them). Clears the table.
pub fn take() -> candle_core::Result<Vec<SectionTime>> {
    let pending = std::mem::take(&mut *PENDING.lock().unwrap_or_else(|e| e.into_inner()));
    for p in pending {
        #[cfg(feature = "cuda")]
        let device = match &p.events {
            Some((begin, end)) => {
                let ms = begin.elapsed_ms(end).map_err(|e| {
                    candle_core::Error::Msg(format!("profile: reading CUDA events: {e}"))
                })?;
                Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)
            }
            None => p.host,
        };
        #[cfg(not(feature = "cuda"))]
        let device = p.host;
        add(p.name, device, p.host, 1);
    }
    Ok(std::mem::take(
        &mut *TABLE.lock().unwrap_or_else(|e| e.into_inner()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both modes in one test: the mode and the tables are process-wide.
    #[test]
    fn sections_add_up_in_both_modes() {
        let dev = Device::Cpu;
        for mode in [Mode::Sync, Mode::Events] {
            set_mode(mode);
            for _ in 0..3 {
                time::<_, candle_core::Error>("test.section", &dev, || {
                    std::thread::sleep(Duration::from_millis(2));
                    Ok(())
                })
                .unwrap();
            }
            let table = take().unwrap();
            let s = table
                .iter()
                .find(|s| s.name == "test.section")
                .cloned()
                .unwrap();
            assert_eq!(s.calls, 3, "{mode:?}");
            assert!(s.host >= Duration::from_millis(6), "{mode:?}: {s:?}");
            assert!(s.device >= Duration::from_millis(6), "{mode:?}: {s:?}");
            assert!(
                take().unwrap().iter().all(|s| s.name != "test.section"),
                "take() clears the table"
            );
        }
        set_mode(Mode::Off);
        time::<_, candle_core::Error>("test.off", &dev, || Ok(())).unwrap();
        assert!(take().unwrap().iter().all(|s| s.name != "test.off"));
    }
}
