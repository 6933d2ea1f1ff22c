//! SIGINT and SIGTERM during training: the first one is recorded and the loop writes a final checkpoint
//! and stops cleanly after the step in progress; the handler then restores the default action, so a
//! second signal ends the process at once. The handlers are installed only while a run trains
//! ([`Guard`]) and the previous ones are put back after it. Plain `libc::signal` with an atomic store
//! is all a handler may do safely (async-signal-safe), so no signal crate is needed.

use std::sync::atomic::{AtomicI32, Ordering};

static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    RECEIVED.store(sig, Ordering::SeqCst);
    // SAFETY: signal() is async-signal-safe; restoring the default action lets a second signal kill.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
    }
}

/// While alive, SIGINT/SIGTERM are recorded instead of ending the process.
pub struct Guard {
    previous: [(libc::c_int, libc::sighandler_t); 2],
}

impl Guard {
    pub fn install() -> Guard {
        RECEIVED.store(0, Ordering::SeqCst);
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only performs an atomic store and signal(), both async-signal-safe.
        let previous = [libc::SIGINT, libc::SIGTERM].map(|s| (s, unsafe { libc::signal(s, handler) }));
        Guard { previous }
    }

    /// The signal received since [`Guard::install`], by name.
    pub fn received(&self) -> Option<&'static str> {
        match RECEIVED.load(Ordering::SeqCst) {
            0 => None,
            libc::SIGINT => Some("SIGINT"),
            libc::SIGTERM => Some("SIGTERM"),
            _ => Some("a signal"),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for (sig, prev) in self.previous {
            // SAFETY: putting back the disposition that was there before install().
            unsafe {
                libc::signal(sig, prev);
            }
        }
    }
}
