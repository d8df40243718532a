//! Finding NCCL's runtime. Its file is `libnccl.so.2` (its soname; NVIDIA's Python wheels,
//! which many machines get NCCL from, ship only that file), a name cudarc 0.19 never tries:
//! it asks the loader for `libnccl.so`, `libnccl.so.13`, `.12`, ..., `.1`. Where only the
//! real name loads, the run's folder gets a link `libnccl.so` to that file, and its rank
//! processes are started with it first on `LD_LIBRARY_PATH` ([`rank_library_path`]): the
//! loader's search path changes, the code that loads NCCL does not.

use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The name NCCL's runtime library is installed under.
const REAL_NAME: &str = "libnccl.so.2";

/// Where the loader finds `name` (its full path), when it loads; the library stays loaded.
fn loaded_path(name: &str, symbol: &str) -> Option<PathBuf> {
    let (name, symbol) = (CString::new(name).ok()?, CString::new(symbol).ok()?);
    // SAFETY: dlopen/dlsym/dladdr with NUL-terminated names; the handle is never closed,
    // so the path dladdr returns (owned by the loader) stays valid while it is copied.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if handle.is_null() {
            return None;
        }
        let address = libc::dlsym(handle, symbol.as_ptr());
        if address.is_null() {
            return None;
        }
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(address as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(PathBuf::from(CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned()))
    }
}

/// NCCL's runtime file, when cudarc cannot find NCCL by its own names but the loader finds
/// `libnccl.so.2` (looked up once per process); None when cudarc finds NCCL as it is, or
/// there is none.
fn only_under_real_name() -> Option<&'static Path> {
    static REAL: OnceLock<Option<PathBuf>> = OnceLock::new();
    REAL.get_or_init(|| {
        if unsafe { cudarc::nccl::sys::is_culib_present() } {
            return None;
        }
        loaded_path(REAL_NAME, "ncclGetVersion")
    })
    .as_deref()
}

/// `LD_LIBRARY_PATH` for the rank processes of a run in `run_dir`: where NCCL is there
/// under its real name only, `run_dir/lib` (made here, holding the link `libnccl.so`)
/// first, then this process's own path; None when nothing needs adding.
pub fn rank_library_path(run_dir: &Path) -> Option<(String, String)> {
    let real = only_under_real_name()?;
    let dir = run_dir.join("lib");
    let link = dir.join("libnccl.so");
    let linked = std::fs::create_dir_all(&dir).and_then(|()| {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(real, &link)
    });
    if let Err(e) = linked {
        tracing::warn!("NCCL is {}, but no link to it could be made in {}: {e}", real.display(), dir.display());
        return None;
    }
    let mut paths = vec![dir];
    if let Some(own) = std::env::var_os("LD_LIBRARY_PATH") {
        paths.extend(std::env::split_paths(&own));
    }
    let joined = std::env::join_paths(paths).ok()?;
    Some(("LD_LIBRARY_PATH".to_string(), joined.to_string_lossy().into_owned()))
}
