//! An ext4 file system on a loop device, for the file backends' tests (`tests/gds.rs`, `tests/gds_cufile.rs`).
//! Needs root; where it cannot be made, the test records a skip of kind `loopdev` (must-run on CI).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

const MIB: u64 = 1 << 20;

fn fresh(dir: &Path, tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    dir.join(format!("loop-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

/// An ext4 file system on a loop device over a file, mounted for the test; unmounted and removed when dropped.
pub struct Ext4 {
    pub dir: PathBuf,
    img: PathBuf,
    dev: String,
}

impl Ext4 {
    /// `size_mib` MiB; None (a skip recorded as kind `loopdev`) where this process cannot make one.
    pub fn new(size_mib: u64) -> Option<Ext4> {
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let img = fresh(&base, "img");
        let dir = fresh(&base, "mnt");
        let sh = |cmd: &mut Command| {
            cmd.output().map_err(|e| e.to_string()).and_then(|o| {
                if o.status.success() {
                    Ok(String::from_utf8_lossy(&o.stdout).trim().to_owned())
                } else {
                    Err(String::from_utf8_lossy(&o.stderr).trim().to_owned())
                }
            })
        };
        let made = (|| {
            std::fs::write(&img, b"").map_err(|e| e.to_string())?;
            File::options()
                .write(true)
                .open(&img)
                .and_then(|f| f.set_len(size_mib * MIB))
                .map_err(|e| e.to_string())?;
            sh(Command::new("mkfs.ext4").args(["-q", "-F", "-m", "0"]).arg(&img))?;
            let dev = sh(Command::new("losetup").args(["-f", "--show"]).arg(&img))?;
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            if let Err(e) = sh(Command::new("mount").arg(&dev).arg(&dir)) {
                let _ = sh(Command::new("losetup").arg("-d").arg(&dev));
                return Err(e);
            }
            Ok(dev)
        })();
        match made {
            Ok(dev) => Some(Ext4 { dir, img, dev }),
            Err(e) => {
                let _ = std::fs::remove_file(&img);
                let _ = std::fs::remove_dir(&dir);
                super::skip("loopdev", &format!("cannot make an ext4 loop device here (root needed): {e}"));
                None
            }
        }
    }
}

impl Drop for Ext4 {
    fn drop(&mut self) {
        let ok = |c: &mut Command| c.status().is_ok_and(|s| s.success());
        if !ok(Command::new("umount").arg(&self.dir)) {
            ok(Command::new("umount").arg("-l").arg(&self.dir));
        }
        ok(Command::new("losetup").arg("-d").arg(&self.dev));
        let _ = std::fs::remove_dir(&self.dir);
        let _ = std::fs::remove_file(&self.img);
    }
}
