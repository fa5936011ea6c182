//! Triton's system shared-memory extension: a client on the same host registers a POSIX
//! shared-memory object (its `key`, an offset and a size) under a region name, then names the
//! region in an input's or requested output's parameters (`shared_memory_region`,
//! `shared_memory_offset`, `shared_memory_byte_size`) instead of sending the tensor's bytes.
//!
//! Inputs are copied out of the region once, when the request is decoded — where the bytes of
//! a wire tensor would be received — so a client rewriting its region after the call returned
//! cannot change a request that is still queued. Outputs are written into their region after
//! inference, and the response names the region instead of carrying the bytes.
//!
//! Registration is refused unless the worker was started with `--allow-client-shm=true`
//! (Triton's flag and default): a registered key opens any shared-memory object the worker's
//! user can open, so only deployments whose clients share the host's trust should allow it.
//! When refused, register and unregister answer UNIMPLEMENTED (Triton's UNSUPPORTED) with the
//! reason; status answers as for a worker with no regions (there are none).
//!
//! CUDA shared memory is answered as a CPU-only Triton answers it (see
//! [`SharedMemory::cuda_register`]): there are never any CUDA regions, so status is empty and
//! unregistering always succeeds (clients' clean-up code calls it unconditionally).
//!
//! Tensors move with `pread`/`pwrite`, never through a mapping, so a client that shrinks a
//! registered object (ftruncate) cannot make the worker fault: every access re-checks the
//! object's size, and a read racing the shrink comes up short and fails that request. A write
//! racing it grows the object back (by at most the region's size).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use nereid_common::{Code, Status};

use crate::tensor::OutputTensor;

/// Tensor parameter: the name of a registered region.
pub const REGION: &str = "shared_memory_region";
/// Tensor parameter: offset of the tensor's bytes in the region (optional, default 0).
pub const OFFSET: &str = "shared_memory_offset";
/// Tensor parameter: size of the tensor's bytes in the region.
pub const BYTE_SIZE: &str = "shared_memory_byte_size";

/// A tensor's shared-memory parameters, as a request states them (not yet resolved).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmRef {
    pub region: String,
    pub offset: u64,
    pub byte_size: u64,
}

impl ShmRef {
    /// Checks the parameters a tensor gave: `None` when it gave none of them. `ctx` names the
    /// tensor in errors (e.g. `input 'X'`).
    pub fn from_parameters(
        ctx: &str,
        region: Option<String>,
        offset: Option<i64>,
        byte_size: Option<i64>,
    ) -> Result<Option<ShmRef>, Status> {
        let (region, byte_size) = match (region, byte_size) {
            (None, None) if offset.is_none() => return Ok(None),
            (Some(r), Some(b)) => (r, b),
            (None, _) => {
                return Err(Status::invalid(format!(
                    "{ctx}: parameter '{REGION}' is required with '{BYTE_SIZE}' and '{OFFSET}'"
                )));
            }
            (Some(_), None) => {
                return Err(Status::invalid(format!("{ctx}: parameter '{BYTE_SIZE}' is required with '{REGION}'")));
            }
        };
        if region.is_empty() {
            return Err(Status::invalid(format!("{ctx}: parameter '{REGION}' is empty")));
        }
        let non_negative = |name: &str, v: i64| {
            u64::try_from(v)
                .map_err(|_| Status::invalid(format!("{ctx}: parameter '{name}' must be non-negative, got {v}")))
        };
        Ok(Some(ShmRef {
            region,
            offset: non_negative(OFFSET, offset.unwrap_or(0))?,
            byte_size: non_negative(BYTE_SIZE, byte_size)?,
        }))
    }
}

/// One registered region, as the status APIs report it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionStatus {
    pub name: String,
    pub key: String,
    pub offset: u64,
    pub byte_size: u64,
}

/// The registered system shared-memory regions of one worker.
pub struct SharedMemory {
    /// `Some(reason)`: client regions are refused, with this reason.
    disabled: Option<&'static str>,
    /// Largest tensor accepted from a region, like a request body's limit: a client's claim is
    /// checked before the copy is allocated.
    max_tensor_bytes: u64,
    /// Regions held at most ([`MAX_REGIONS`]).
    max_regions: usize,
    regions: RwLock<BTreeMap<String, Arc<Region>>>,
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory").field("disabled", &self.disabled).finish_non_exhaustive()
    }
}

/// Regions one worker holds at most (each keeps a descriptor open).
pub const MAX_REGIONS: usize = 1024;

const DISABLED: &str =
    "client shared memory is disabled on this worker; start nereid-worker with --allow-client-shm=true to allow it";

impl SharedMemory {
    /// Regions allowed (`--allow-client-shm=true`); tensors up to `max_tensor_bytes` each.
    pub fn allowed(max_tensor_bytes: u64) -> Self {
        SharedMemory { disabled: None, max_tensor_bytes, max_regions: MAX_REGIONS, regions: RwLock::default() }
    }

    /// Regions refused with the worker's reason (`--allow-client-shm=false`).
    pub fn disabled() -> Self {
        Self::refused(DISABLED)
    }

    /// Regions refused with `reason` (e.g. a process that forwards requests elsewhere).
    pub fn refused(reason: &'static str) -> Self {
        SharedMemory { disabled: Some(reason), max_tensor_bytes: 0, max_regions: 0, regions: RwLock::default() }
    }

    pub fn enabled(&self) -> bool {
        self.disabled.is_none()
    }

    /// Register and unregister on a worker refusing regions: UNIMPLEMENTED (what Triton
    /// answers for an unsupported API), with the reason.
    fn check_enabled(&self) -> Result<(), Status> {
        match self.disabled {
            Some(reason) => Err(Status::unimplemented(reason)),
            None => Ok(()),
        }
    }

    /// The NOT_FOUND for a region a tensor names that is not registered (Triton's wording
    /// first); on a worker refusing regions, with the reason.
    fn not_registered(&self, ctx: &str, name: &str) -> Status {
        let reason = self.disabled.map(|r| format!("; {r}")).unwrap_or_default();
        Status::not_found(format!("Unable to find shared memory region: '{name}' ({ctx}){reason}"))
    }

    /// The refusal of a tensor naming `region` on a worker refusing regions (`None` where they
    /// are allowed): what to answer before looking at anything else about the tensor.
    pub fn refusal(&self, ctx: &str, region: &str) -> Option<Status> {
        self.disabled.map(|_| self.not_registered(ctx, region))
    }

    /// Opens `key` (a POSIX shared-memory object name) and maps `byte_size` bytes from
    /// `offset` under `name`. The object must already hold them.
    pub fn register(&self, name: &str, key: &str, offset: u64, byte_size: u64) -> Result<(), Status> {
        self.check_enabled()?;
        if name.is_empty() {
            return Err(Status::invalid("a shared memory region needs a name"));
        }
        if byte_size == 0 {
            return Err(Status::invalid(format!("shared memory region '{name}': byte_size must be positive")));
        }
        let full = |n: usize| {
            (n >= self.max_regions).then(|| {
                Status::exhausted(format!(
                    "{n} shared memory regions are registered, the most a worker holds; unregister some first"
                ))
            })
        };
        {
            let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
            if regions.contains_key(name) {
                return Err(already_registered(name));
            }
            if let Some(e) = full(regions.len()) {
                return Err(e);
            }
        }
        let region = Arc::new(Region::open(name, key, offset, byte_size)?);
        let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
        if regions.contains_key(name) {
            return Err(already_registered(name));
        }
        if let Some(e) = full(regions.len()) {
            return Err(e);
        }
        regions.insert(name.to_string(), region);
        tracing::info!(region = name, key, offset, byte_size, "registered system shared memory region");
        Ok(())
    }

    /// Unregisters `name`, or every region when `None`. Unknown names are not an error (as in
    /// Triton, so clean-up code can always call it). Requests already holding the region keep
    /// its mapping until they finish.
    pub fn unregister(&self, name: Option<&str>) -> Result<(), Status> {
        self.check_enabled()?;
        let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
        match name {
            Some(name) => {
                if regions.remove(name).is_some() {
                    tracing::info!(region = name, "unregistered system shared memory region");
                }
            }
            None => regions.clear(),
        }
        Ok(())
    }

    /// Status of `name`, or of every region when `None`. A worker refusing regions answers as
    /// one with none registered (as Triton's status does), naming the reason for a named one.
    pub fn status(&self, name: Option<&str>) -> Result<Vec<RegionStatus>, Status> {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        match name {
            Some(name) => regions.get(name).map(|r| vec![r.status()]).ok_or_else(|| {
                let reason = self.disabled.map(|r| format!("; {r}")).unwrap_or_default();
                Status::not_found(format!("Unable to find system shared memory region: '{name}'{reason}"))
            }),
            None => Ok(regions.values().map(|r| r.status()).collect()),
        }
    }

    /// CUDA shared-memory status: there are never any CUDA regions, so `Ok` (an empty status)
    /// for all of them, NOT_FOUND for a named one, as a Triton built without GPUs answers.
    pub fn cuda_status(&self, name: Option<&str>) -> Result<(), Status> {
        match name {
            Some(name) => Err(Status::not_found(format!("Unable to find cuda shared memory region: '{name}'"))),
            None => Ok(()),
        }
    }

    /// Registering a CUDA shared-memory region: refused with INVALID_ARGUMENT, Triton's answer
    /// without GPUs (UNIMPLEMENTED, like the system regions, on a worker refusing regions).
    pub fn cuda_register(&self, name: &str) -> Result<(), Status> {
        self.check_enabled()?;
        Err(Status::invalid(format!("failed to register CUDA shared memory region: '{name}', GPUs not supported")))
    }

    /// Unregistering CUDA shared-memory regions (`name`, or all when `None`): there are none,
    /// so it always succeeds, as in Triton — clients call it at start-up and clean-up whether
    /// they used CUDA regions or not (UNIMPLEMENTED on a worker refusing regions).
    pub fn cuda_unregister(&self, _name: Option<&str>) -> Result<(), Status> {
        self.check_enabled()
    }

    fn lookup(&self, ctx: &str, r: &ShmRef) -> Result<Arc<Region>, Status> {
        let region = self.regions.read().unwrap_or_else(|e| e.into_inner()).get(&r.region).cloned();
        let region = region.ok_or_else(|| self.not_registered(ctx, &r.region))?;
        let end = r.offset.checked_add(r.byte_size);
        if end.is_none_or(|end| end > region.byte_size) {
            return Err(Status::invalid(format!(
                "{ctx}: {BYTE_SIZE} {} at {OFFSET} {} does not fit in region '{}' of {} bytes",
                r.byte_size, r.offset, r.region, region.byte_size
            )));
        }
        Ok(region)
    }

    /// What one request may copy out of regions in all ([`SharedMemory::read`]'s `budget`):
    /// the request size limit, as for the bytes of a request body.
    pub fn request_budget(&self) -> u64 {
        self.max_tensor_bytes
    }

    /// Copies a tensor's bytes out of its region, taking them from `budget` (what the request's
    /// other shared-memory inputs left of [`SharedMemory::request_budget`]) before anything is
    /// allocated: however many inputs name a large region, a request copies no more than a
    /// request body may hold.
    pub fn read(&self, ctx: &str, r: &ShmRef, budget: &mut u64) -> Result<Bytes, Status> {
        if !self.enabled() {
            return Err(self.not_registered(ctx, &r.region));
        }
        if r.byte_size > *budget {
            return Err(Status::invalid(format!(
                "{ctx}: {BYTE_SIZE} {} with the request's other shared memory inputs exceeds the request size \
                 limit of {} bytes",
                r.byte_size, self.max_tensor_bytes
            )));
        }
        let region = self.lookup(ctx, r)?;
        *budget -= r.byte_size;
        let mut buf = vec![0u8; r.byte_size as usize];
        region.copy_out(ctx, r.offset, &mut buf)?;
        Ok(Bytes::from(buf))
    }

    /// Resolves where a requested output goes (checked before inference runs).
    pub fn target(&self, ctx: &str, r: &ShmRef) -> Result<ShmTarget, Status> {
        let region = self.lookup(ctx, r)?;
        Ok(ShmTarget { region, offset: r.offset, byte_size: r.byte_size })
    }
}

/// An output the front end wrote into shared memory: the response names its region and size
/// instead of carrying its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmWritten {
    pub name: String,
    pub region: String,
    pub byte_size: u64,
}

/// Writes each output that has a target into its region and empties its data in `outputs`;
/// returns what was written, for the response to report. An output that does not fit fails
/// the request (its region may then hold part of the outputs written before it).
pub fn write_outputs(outputs: &mut [OutputTensor], targets: &[(String, ShmTarget)]) -> Result<Vec<ShmWritten>, Status> {
    let mut written = Vec::with_capacity(targets.len());
    for output in outputs.iter_mut() {
        let Some((_, target)) = targets.iter().find(|(name, _)| *name == output.name) else {
            continue;
        };
        target.write(&output.name, &output.data)?;
        written.push(ShmWritten {
            name: output.name.clone(),
            region: target.region_name().to_string(),
            byte_size: output.data.len() as u64,
        });
        output.data = Bytes::new();
    }
    Ok(written)
}

/// Copies larger than this run on the blocking pool, not on the async threads that serve
/// other connections.
pub const OFFLOAD_BYTES: u64 = 1 << 20;

/// [`write_outputs`], on the blocking pool when the bytes to write exceed [`OFFLOAD_BYTES`].
pub async fn write_outputs_offloaded(
    mut outputs: Vec<OutputTensor>,
    targets: Vec<(String, ShmTarget)>,
) -> Result<(Vec<OutputTensor>, Vec<ShmWritten>), Status> {
    if targets.is_empty() {
        return Ok((outputs, Vec::new()));
    }
    let bytes: u64 =
        outputs.iter().filter(|o| targets.iter().any(|(n, _)| *n == o.name)).map(|o| o.data.len() as u64).sum();
    if bytes <= OFFLOAD_BYTES {
        let written = write_outputs(&mut outputs, &targets)?;
        return Ok((outputs, written));
    }
    tokio::task::spawn_blocking(move || write_outputs(&mut outputs, &targets).map(|w| (outputs, w)))
        .await
        .map_err(|e| Status::internal(format!("shared memory output task failed: {e}")))?
}

fn already_registered(name: &str) -> Status {
    Status::new(
        Code::AlreadyExists,
        format!("a shared memory region named '{name}' is already registered; unregister it first"),
    )
}

/// Where one requested output is written: a registered region (kept mapped while the request
/// runs, even if it is unregistered meanwhile), an offset and the room the client gave.
#[derive(Clone)]
pub struct ShmTarget {
    region: Arc<Region>,
    offset: u64,
    byte_size: u64,
}

impl std::fmt::Debug for ShmTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTarget")
            .field("region", &self.region.name)
            .field("offset", &self.offset)
            .field("byte_size", &self.byte_size)
            .finish()
    }
}

impl ShmTarget {
    pub fn region_name(&self) -> &str {
        &self.region.name
    }

    /// Writes an output's bytes; fails, naming the output, when they do not fit the room the
    /// request gave.
    pub fn write(&self, output: &str, data: &[u8]) -> Result<(), Status> {
        if data.len() as u64 > self.byte_size {
            return Err(Status::invalid(format!(
                "output '{output}': {} bytes do not fit the {BYTE_SIZE} of {} given for region '{}'",
                data.len(),
                self.byte_size,
                self.region.name
            )));
        }
        self.region.copy_in(&format!("output '{output}'"), self.offset, data)
    }
}

/// A registered region: the shared-memory object, open, and where the region lies in it.
///
/// Tensors are copied with `pread`/`pwrite` on the descriptor rather than through a mapping:
/// the same single copy, but an object the client truncated, or a sparse one whose pages
/// cannot be allocated (a full `/dev/shm`), is an error for that request instead of a SIGBUS
/// for the whole worker.
struct Region {
    name: String,
    key: String,
    offset: u64,
    byte_size: u64,
    file: std::fs::File,
}

fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl Region {
    fn open(name: &str, key: &str, offset: u64, byte_size: u64) -> Result<Region, Status> {
        let ctx = format!("shared memory region '{name}' (key '{key}')");
        let invalid = |m: String| Status::invalid(format!("{ctx}: {m}"));
        let ckey = CString::new(key).map_err(|_| invalid("the key contains a NUL byte".into()))?;
        if key.trim_start_matches('/').is_empty() || key.trim_start_matches('/').contains('/') {
            return Err(invalid("the key must be a shared memory object name such as '/my_region'".into()));
        }
        let end = offset.checked_add(byte_size).ok_or_else(|| invalid("offset + byte_size overflows".into()))?;
        // SAFETY: shm_open with a valid NUL-terminated name; the result is checked.
        let raw = unsafe { libc::shm_open(ckey.as_ptr(), libc::O_RDWR, 0) };
        if raw < 0 {
            return Err(invalid(os_error("cannot open the shared memory object")));
        }
        // SAFETY: `raw` is a descriptor just returned to us and owned by nobody else.
        let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        let size = object_size(&file).map_err(invalid)?;
        if end > size {
            return Err(invalid(format!(
                "offset {offset} + byte_size {byte_size} exceeds the object's size of {size} bytes"
            )));
        }
        Ok(Region { name: name.to_string(), key: key.to_string(), offset, byte_size, file })
    }

    fn status(&self) -> RegionStatus {
        RegionStatus { name: self.name.clone(), key: self.key.clone(), offset: self.offset, byte_size: self.byte_size }
    }

    /// Checks that `[at, at + len)` (relative to the region) is inside it and that the object
    /// still holds it; returns its position in the object.
    fn span(&self, ctx: &str, at: u64, len: usize) -> Result<u64, Status> {
        let end = at.checked_add(len as u64);
        if end.is_none_or(|end| end > self.byte_size) {
            return Err(Status::invalid(format!(
                "{ctx}: {len} bytes at offset {at} do not fit region '{}' of {} bytes",
                self.name, self.byte_size
            )));
        }
        let size = object_size(&self.file).map_err(Status::internal)?;
        if self.offset + at + len as u64 > size {
            return Err(self.shrunk(ctx, size));
        }
        Ok(self.offset + at)
    }

    fn shrunk(&self, ctx: &str, size: u64) -> Status {
        Status::invalid(format!(
            "{ctx}: the shared memory object behind region '{}' (key '{}') has shrunk to {size} bytes; \
             register the region again",
            self.name, self.key
        ))
    }

    fn copy_out(&self, ctx: &str, at: u64, dst: &mut [u8]) -> Result<(), Status> {
        let pos = self.span(ctx, at, dst.len())?;
        self.file.read_exact_at(dst, pos).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => self.shrunk(ctx, object_size(&self.file).unwrap_or(0)),
            _ => Status::internal(format!("{ctx}: cannot read shared memory region '{}': {e}", self.name)),
        })
    }

    fn copy_in(&self, ctx: &str, at: u64, src: &[u8]) -> Result<(), Status> {
        let pos = self.span(ctx, at, src.len())?;
        self.file
            .write_all_at(src, pos)
            .map_err(|e| Status::unavailable(format!("{ctx}: cannot write shared memory region '{}': {e}", self.name)))
    }
}

fn object_size(file: &std::fs::File) -> Result<u64, String> {
    file.metadata().map(|m| m.len()).map_err(|e| format!("cannot stat the shared memory object: {e}"))
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use std::os::fd::AsRawFd;

    /// A POSIX shared-memory object for one test, unlinked on drop.
    pub(crate) struct TestObject {
        pub(crate) key: String,
        fd: OwnedFd,
    }

    impl TestObject {
        pub(crate) fn new(tag: &str, size: usize) -> TestObject {
            let key = format!("/nereid-test-{}-{tag}", std::process::id());
            let c = CString::new(key.clone()).unwrap();
            let raw = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600) };
            assert!(raw >= 0, "{}", os_error("shm_open"));
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) }, 0);
            TestObject { key, fd }
        }

        pub(crate) fn write(&self, at: usize, data: &[u8]) {
            let n = unsafe { libc::pwrite(self.fd.as_raw_fd(), data.as_ptr().cast(), data.len(), at as libc::off_t) };
            assert_eq!(n, data.len() as isize);
        }

        pub(crate) fn read(&self, at: usize, len: usize) -> Vec<u8> {
            let mut buf = vec![0u8; len];
            let n = unsafe { libc::pread(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), len, at as libc::off_t) };
            assert_eq!(n, len as isize);
            buf
        }

        pub(crate) fn truncate(&self, size: usize) {
            assert_eq!(unsafe { libc::ftruncate(self.fd.as_raw_fd(), size as libc::off_t) }, 0);
        }
    }

    impl Drop for TestObject {
        fn drop(&mut self) {
            let c = CString::new(self.key.clone()).unwrap();
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::TestObject;
    use super::*;

    fn r(region: &str, offset: u64, byte_size: u64) -> ShmRef {
        ShmRef { region: region.into(), offset, byte_size }
    }

    #[test]
    fn parameters_must_come_together_and_be_non_negative() {
        let p = |region: Option<&str>, offset, size| {
            ShmRef::from_parameters("input 'X'", region.map(Into::into), offset, size)
        };
        assert_eq!(p(None, None, None).unwrap(), None);
        assert_eq!(p(Some("a"), None, Some(8)).unwrap(), Some(r("a", 0, 8)));
        assert_eq!(p(Some("a"), Some(4), Some(8)).unwrap(), Some(r("a", 4, 8)));
        for (region, offset, size, needle) in [
            (Some("a"), None, None, "'shared_memory_byte_size' is required"),
            (None, None, Some(8), "'shared_memory_region' is required"),
            (None, Some(0), None, "'shared_memory_region' is required"),
            (Some(""), None, Some(8), "is empty"),
            (Some("a"), Some(-1), Some(8), "'shared_memory_offset' must be non-negative"),
            (Some("a"), None, Some(-8), "'shared_memory_byte_size' must be non-negative"),
        ] {
            let e = p(region, offset, size).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(e.message.contains(needle) && e.message.starts_with("input 'X'"), "{}", e.message);
        }
    }

    #[test]
    fn register_read_write_status_unregister() {
        let obj = TestObject::new("rw", 10_000);
        obj.write(5000, b"hello shared memory");
        let shm = SharedMemory::allowed(1 << 20);
        // An offset that is not page-aligned maps from the page below.
        shm.register("in", &obj.key, 4996, 1000).unwrap();
        assert_eq!(
            shm.status(None).unwrap(),
            vec![RegionStatus { name: "in".into(), key: obj.key.clone(), offset: 4996, byte_size: 1000 }]
        );
        assert_eq!(&shm.read("input 'X'", &r("in", 4, 5), &mut { u64::MAX }).unwrap()[..], b"hello");

        let target = shm.target("output 'Y'", &r("in", 100, 8)).unwrap();
        target.write("Y", b"12345678").unwrap();
        assert_eq!(obj.read(4996 + 100, 8), b"12345678");
        let e = target.write("Y", b"123456789").unwrap_err();
        assert!(e.message.contains("9 bytes do not fit the shared_memory_byte_size of 8"), "{}", e.message);

        // Out of the region's bounds, and unknown regions.
        let e = shm.read("input 'X'", &r("in", 999, 2), &mut { u64::MAX }).unwrap_err();
        assert!(e.message.contains("does not fit in region 'in' of 1000 bytes"), "{}", e.message);
        let e = shm.read("input 'X'", &r("in", u64::MAX, 2), &mut { u64::MAX }).unwrap_err();
        assert!(e.message.contains("does not fit"), "{}", e.message);
        let e = shm.read("input 'X'", &r("nope", 0, 2), &mut { u64::MAX }).unwrap_err();
        assert_eq!(e.code, Code::NotFound);
        assert_eq!(e.message, "Unable to find shared memory region: 'nope' (input 'X')");
        let e = shm.target("output 'Y'", &r("nope", 0, 2)).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (Code::NotFound, "Unable to find shared memory region: 'nope' (output 'Y')")
        );
        let e = shm.status(Some("nope")).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (Code::NotFound, "Unable to find system shared memory region: 'nope'")
        );

        // A second registration of the name is refused; the first stays.
        let e = shm.register("in", &obj.key, 0, 10).unwrap_err();
        assert_eq!(e.code, Code::AlreadyExists);
        assert_eq!(shm.status(Some("in")).unwrap()[0].offset, 4996);

        // Unregistering keeps the mapping alive for a request that holds it.
        shm.unregister(Some("in")).unwrap();
        shm.unregister(Some("in")).unwrap();
        assert!(shm.status(None).unwrap().is_empty());
        target.write("Y", b"abcdefgh").unwrap();
        assert_eq!(obj.read(4996 + 100, 8), b"abcdefgh");
        assert!(shm.read("input 'X'", &r("in", 0, 1), &mut { u64::MAX }).is_err());
    }

    #[test]
    fn bad_registrations_are_refused_with_reasons() {
        let obj = TestObject::new("bad", 4096);
        let shm = SharedMemory::allowed(1 << 20);
        for (name, key, offset, size, needle) in [
            ("a", obj.key.as_str(), 0, 4097, "exceeds the object's size of 4096 bytes"),
            ("a", obj.key.as_str(), 4000, 100, "exceeds the object's size"),
            ("a", obj.key.as_str(), u64::MAX, 2, "overflows"),
            ("a", obj.key.as_str(), 0, 0, "byte_size must be positive"),
            ("", obj.key.as_str(), 0, 8, "needs a name"),
            ("a", "/nereid-test-does-not-exist", 0, 8, "cannot open the shared memory object"),
            ("a", "/../etc/passwd", 0, 8, "must be a shared memory object name"),
            ("a", "", 0, 8, "must be a shared memory object name"),
            ("a", "bad\0key", 0, 8, "NUL"),
        ] {
            let e = shm.register(name, key, offset, size).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument, "{}", e.message);
            assert!(e.message.contains(needle), "{needle}: {}", e.message);
        }
        assert!(shm.status(None).unwrap().is_empty());
    }

    #[test]
    fn a_shrunk_object_is_an_error_not_a_fault() {
        let obj = TestObject::new("shrink", 8192);
        let shm = SharedMemory::allowed(1 << 20);
        shm.register("r", &obj.key, 0, 8192).unwrap();
        obj.truncate(100);
        let e = shm.read("input 'X'", &r("r", 4096, 16), &mut { u64::MAX }).unwrap_err();
        assert!(e.message.contains("has shrunk to 100 bytes"), "{}", e.message);
        assert_eq!(shm.read("input 'X'", &r("r", 0, 16), &mut { u64::MAX }).unwrap().len(), 16);
    }

    #[tokio::test]
    async fn large_outputs_are_written_off_the_async_threads_and_small_ones_inline() {
        let obj = TestObject::new("offload", 4 << 20);
        let shm = SharedMemory::allowed(8 << 20);
        shm.register("out", &obj.key, 0, 4 << 20).unwrap();
        for size in [16usize, (2 << 20) + 4] {
            let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let outputs = vec![OutputTensor {
                name: "Y".into(),
                datatype: nereid_common::DataType::Uint8,
                shape: vec![size as i64],
                data: Bytes::from(data.clone()),
            }];
            let targets = vec![("Y".to_string(), shm.target("output 'Y'", &r("out", 8, size as u64)).unwrap())];
            let (outputs, written) = write_outputs_offloaded(outputs, targets).await.unwrap();
            assert!(outputs[0].data.is_empty());
            assert_eq!(written, vec![ShmWritten { name: "Y".into(), region: "out".into(), byte_size: size as u64 }]);
            assert_eq!(obj.read(8, size), data);
        }
    }

    #[test]
    fn the_number_of_regions_is_bounded() {
        let obj = TestObject::new("cap", 64);
        let shm = SharedMemory { max_regions: 2, ..SharedMemory::allowed(1 << 20) };
        shm.register("a", &obj.key, 0, 64).unwrap();
        shm.register("b", &obj.key, 0, 64).unwrap();
        let e = shm.register("c", &obj.key, 0, 64).unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        assert!(e.message.contains("2 shared memory regions are registered"), "{}", e.message);
        shm.unregister(Some("a")).unwrap();
        shm.register("c", &obj.key, 0, 64).unwrap();
    }

    #[test]
    fn limits_and_disabled() {
        let obj = TestObject::new("limit", 4096);
        let shm = SharedMemory::allowed(64);
        shm.register("r", &obj.key, 0, 4096).unwrap();
        let mut budget = shm.request_budget();
        let e = shm.read("input 'X'", &r("r", 0, 65), &mut budget).unwrap_err();
        assert!(e.message.contains("exceeds the request size limit of 64 bytes"), "{}", e.message);
        // The limit holds for the request's inputs together, not each alone.
        assert_eq!(shm.read("input 'X'", &r("r", 0, 40), &mut budget).unwrap().len(), 40);
        let e = shm.read("input 'Y'", &r("r", 0, 40), &mut budget).unwrap_err();
        assert!(e.message.contains("with the request's other shared memory inputs exceeds"), "{}", e.message);
        assert_eq!(budget, 24);

        // Refused: register and unregister are UNIMPLEMENTED (Triton's UNSUPPORTED); status
        // answers as for no regions; a tensor naming a region finds none. All give the reason.
        let off = SharedMemory::disabled();
        for (e, code) in [
            (off.register("r", &obj.key, 0, 8).unwrap_err(), Code::Unimplemented),
            (off.unregister(None).unwrap_err(), Code::Unimplemented),
            (off.unregister(Some("r")).unwrap_err(), Code::Unimplemented),
            (off.status(Some("r")).unwrap_err(), Code::NotFound),
            (off.read("input 'X'", &r("r", 0, 8), &mut { u64::MAX }).unwrap_err(), Code::NotFound),
            (off.target("output 'Y'", &r("r", 0, 8)).unwrap_err(), Code::NotFound),
        ] {
            assert_eq!(e.code, code, "{}", e.message);
            assert!(e.message.contains("--allow-client-shm=true"), "{}", e.message);
        }
        assert_eq!(off.status(None).unwrap(), vec![]);
        let e = off.read("input 'X'", &r("r", 0, 8), &mut { u64::MAX }).unwrap_err();
        assert!(e.message.starts_with("Unable to find shared memory region: 'r' (input 'X')"), "{}", e.message);
    }

    #[test]
    fn cuda_shared_memory_is_answered_as_a_triton_without_gpus_answers() {
        for shm in [SharedMemory::allowed(1 << 20), SharedMemory::disabled()] {
            // Status does not depend on whether regions are allowed: there are never any.
            shm.cuda_status(None).unwrap();
            let e = shm.cuda_status(Some("c")).unwrap_err();
            assert_eq!((e.code, e.message.as_str()), (Code::NotFound, "Unable to find cuda shared memory region: 'c'"));
        }
        let on = SharedMemory::allowed(1 << 20);
        on.cuda_unregister(None).unwrap();
        on.cuda_unregister(Some("c")).unwrap();
        let e = on.cuda_register("c").unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert_eq!(e.message, "failed to register CUDA shared memory region: 'c', GPUs not supported");

        let off = SharedMemory::disabled();
        for e in [off.cuda_register("c").unwrap_err(), off.cuda_unregister(None).unwrap_err()] {
            assert_eq!(e.code, Code::Unimplemented);
            assert!(e.message.contains("--allow-client-shm=true"), "{}", e.message);
        }
    }
}
