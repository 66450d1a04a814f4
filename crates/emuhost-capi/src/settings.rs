//! `emuhost_settings_t`: the typed switches (`emuhost::settings::Settings`), set by name in code,
//! or read from the environment when the embedder asks. Constructors that take settings accept
//! NULL for the defaults.

use std::ffi::c_char;
use std::sync::{Arc, Mutex};

use emuhost::settings::Settings;

use crate::entry;
use crate::error::{EMUHOST_ERROR_REFUSED, Error, emuhost_error_t};
use crate::ffi::text;
use crate::handle::{self, Kind};

/// Settings (opaque): one value per `EMUHOST_*` switch (the README's table).
///
/// Thread safety: may be used from several threads at once (a set is atomic; a constructor reads
/// the settings as they are when it is called). Handles made from settings keep no link to them.
pub struct emuhost_settings_t {
    _private: [u8; 0],
}

pub(crate) struct SettingsCell(Mutex<Settings>);

impl Kind for SettingsCell {
    type C = emuhost_settings_t;
    const NAME: &'static str = "settings";
}

/// A copy of the settings behind `s`, or the defaults where `s` is NULL.
pub(crate) fn read(s: *const emuhost_settings_t, what: &str) -> Result<Settings, Error> {
    if s.is_null() {
        return Ok(Settings::default());
    }
    Ok(handle::get::<SettingsCell>(s, what)?.0.lock().unwrap_or_else(|p| p.into_inner()).clone())
}

fn make(settings: Settings, out: *mut *mut emuhost_settings_t) -> Result<(), Error> {
    // SAFETY: as the caller vouches (`out` NULL or writable).
    unsafe { handle::give(out, Arc::new(SettingsCell(Mutex::new(settings)))) }
}

/// New settings with every switch at its default. No environment variable is read.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_settings_new(out: *mut *mut emuhost_settings_t) -> *mut emuhost_error_t {
    entry(|| make(Settings::default(), out))
}

/// New settings from the process's environment: each `EMUHOST_*` switch that is set takes its
/// value (the only way emuhost reads the environment). A bad value is an error naming it.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_settings_from_env(out: *mut *mut emuhost_settings_t) -> *mut emuhost_error_t {
    entry(|| make(Settings::from_env()?, out))
}

/// Sets the switch `name` (e.g. `"EMUHOST_WATCH"`) to `value` (UTF-8; empty is the default for
/// most). An unknown name or a refused value is an `EMUHOST_ERROR_SETTING` naming both, and
/// nothing changes.
///
/// # Safety
/// `name` and `value` are NULL or NUL-terminated strings.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_settings_set(
    settings: *mut emuhost_settings_t,
    name: *const c_char,
    value: *const c_char,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = handle::get::<SettingsCell>(settings, "emuhost_settings_set")?;
        // SAFETY: as the caller vouches.
        let (name, value) = unsafe { (text(name, "the name")?, text(value, "the value")?) };
        s.0.lock().unwrap_or_else(|p| p.into_inner()).set(name, value)?;
        Ok(())
    })
}

/// Makes the settings' `EMUHOST_FAULT_*` switches the process's fault plan (a build with the
/// `faults` feature; in another, setting one is already an error). Only the first plan of the
/// process holds: a different one later is `EMUHOST_ERROR_REFUSED`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_settings_install_faults(settings: *const emuhost_settings_t) -> *mut emuhost_error_t {
    entry(|| {
        let s = read(settings, "emuhost_settings_install_faults")?;
        if emuhost::faults::install(&s.faults) {
            Ok(())
        } else {
            Err(Error::new(EMUHOST_ERROR_REFUSED, "the process's fault plan was fixed already, and differs"))
        }
    })
}

/// Deletes settings. NULL does nothing; a handle deleted already is `EMUHOST_ERROR_BAD_HANDLE`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_settings_delete(settings: *mut emuhost_settings_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<SettingsCell>(settings))
}
