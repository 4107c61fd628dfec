//! An opt-in section profiler: once [`set_enabled`] turned it on (`prism bench --profile`), [`time`]
//! synchronizes the device before and after a section and adds the elapsed wall time to a global table,
//! which `prism bench` prints. Off (the default), it costs one relaxed atomic load per section.
//!
//! The synchronizations serialize the host and the device, so a profiled run is slower than a plain
//! one: the table says where device time goes, not the latency of an unprofiled run.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::Device;

/// 0: off, 1: on.
static STATE: AtomicU8 = AtomicU8::new(0);
static TABLE: Mutex<Vec<(&'static str, Duration, u64)>> = Mutex::new(Vec::new());

/// Whether profiling is on.
pub fn enabled() -> bool {
    STATE.load(Ordering::Relaxed) == 1
}

/// Turns profiling on or off for the whole process.
pub fn set_enabled(on: bool) {
    STATE.store(u8::from(on), Ordering::Relaxed);
}

/// Runs `f` as section `name`, timed between two device synchronizations when profiling is on.
pub fn time<T, E: From<candle_core::Error>>(
    name: &'static str,
    device: &Device,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    if !enabled() {
        return f();
    }
    device.synchronize()?;
    let start = Instant::now();
    let out = f()?;
    device.synchronize()?;
    add(name, start.elapsed());
    Ok(out)
}

/// A section timed from [`Section::start`] to [`Section::stop`] (for code that cannot be a closure).
pub struct Section {
    name: &'static str,
    device: Device,
    start: Option<Instant>,
}

impl Section {
    pub fn start(name: &'static str, device: &Device) -> candle_core::Result<Self> {
        let start = if enabled() {
            device.synchronize()?;
            Some(Instant::now())
        } else {
            None
        };
        Ok(Self {
            name,
            device: device.clone(),
            start,
        })
    }

    pub fn stop(self) -> candle_core::Result<()> {
        if let Some(start) = self.start {
            self.device.synchronize()?;
            add(self.name, start.elapsed());
        }
        Ok(())
    }
}

fn add(name: &'static str, elapsed: Duration) {
    let mut table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    match table.iter_mut().find(|(n, _, _)| *n == name) {
        Some(entry) => {
            entry.1 += elapsed;
            entry.2 += 1;
        }
        None => table.push((name, elapsed, 1)),
    }
}

/// The sections timed since the last call, in first-seen order: (name, total time, calls). Clears the table.
pub fn take() -> Vec<(&'static str, Duration, u64)> {
    std::mem::take(&mut *TABLE.lock().unwrap_or_else(|e| e.into_inner()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_add_up_when_enabled() {
        set_enabled(true);
        let dev = Device::Cpu;
        for _ in 0..3 {
            time::<_, candle_core::Error>("test.section", &dev, || {
                std::thread::sleep(Duration::from_millis(2));
                Ok(())
            })
            .unwrap();
        }
        let table = take();
        let (_, total, calls) = table
            .iter()
            .find(|(n, _, _)| *n == "test.section")
            .copied()
            .unwrap();
        assert_eq!(calls, 3);
        assert!(total >= Duration::from_millis(6), "{total:?}");
        assert!(
            take().iter().all(|(n, _, _)| *n != "test.section"),
            "take() clears the table"
        );
        set_enabled(false);
    }
}
