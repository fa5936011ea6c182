//! `--shared-memory system`, as perf_analyzer's: the run's input tensors are written once into
//! a POSIX shared-memory object registered with the server (Triton's system shared-memory
//! extension), requests name their slice of it instead of carrying the bytes, and outputs are
//! written by the server into a second registered object — one slot per model output, shared
//! by every request and never read, as perf_analyzer does. Only for a server on this host.
//!
//! The objects are unlinked when [`ShmRun`] is dropped; [`ShmRun::release`] also unregisters
//! the regions, which frees the server's mapping.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::{Client, ClientError};
use crate::workload::{InputTensor, TensorSpec};

/// Each input starts on a multiple of this (the server copies from it).
const ALIGN: u64 = 64;

/// A tensor's slice of a registered region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmSlice {
    pub region: String,
    pub offset: u64,
    pub byte_size: u64,
}

/// Where one prepared request's tensors are: its inputs, in order, and every output of its
/// model, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShmRequest {
    pub inputs: Vec<ShmSlice>,
    pub outputs: Vec<(String, ShmSlice)>,
}

/// One POSIX shared-memory object created by this process; unlinked on drop.
#[derive(Debug)]
struct Object {
    key: String,
    fd: OwnedFd,
    size: u64,
}

fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl Object {
    fn create(key: &str, size: u64) -> Result<Object, String> {
        let c = CString::new(key).map_err(|_| format!("shared memory key '{key}' contains a NUL byte"))?;
        // SAFETY: a valid NUL-terminated name; the result is checked.
        let raw = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600) };
        if raw < 0 {
            return Err(os_error(&format!("cannot create shared memory object '{key}'")));
        }
        // SAFETY: a descriptor just returned to us, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let object = Object { key: key.to_string(), fd, size };
        let len = libc::off_t::try_from(size).map_err(|_| format!("{size} bytes of shared memory is too large"))?;
        // SAFETY: ftruncate on our own descriptor.
        if unsafe { libc::ftruncate(object.fd.as_raw_fd(), len) } != 0 {
            return Err(os_error(&format!("cannot size shared memory object '{key}' to {size} bytes")));
        }
        Ok(object)
    }

    fn write_at(&self, mut offset: u64, mut data: &[u8]) -> Result<(), String> {
        while !data.is_empty() {
            // SAFETY: pwrite from a live slice into our own descriptor.
            let n =
                unsafe { libc::pwrite(self.fd.as_raw_fd(), data.as_ptr().cast(), data.len(), offset as libc::off_t) };
            if n <= 0 {
                return Err(os_error(&format!("cannot write shared memory object '{}'", self.key)));
            }
            data = &data[n as usize..];
            offset += n as u64;
        }
        Ok(())
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        if let Ok(c) = CString::new(self.key.clone()) {
            // SAFETY: unlinking a name; the open descriptor stays valid until it is closed.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
}

/// The shared memory of one run.
pub struct ShmRun {
    input: Object,
    output: Object,
    input_region: String,
    output_region: String,
    /// Next free byte of the input object.
    cursor: u64,
    /// `(model, output)` → offset of its slot in the output object.
    output_slots: Vec<((String, String), u64)>,
    output_size: u64,
    registered: Vec<String>,
}

impl ShmRun {
    /// Bytes the input object needs for these requests' inputs, aligned as [`ShmRun::place`]
    /// lays them out.
    pub fn input_bytes<'a>(requests: impl IntoIterator<Item = &'a [InputTensor]>) -> u64 {
        requests.into_iter().flatten().map(|i| (i.data.len() as u64).div_ceil(ALIGN) * ALIGN).sum::<u64>().max(ALIGN)
    }

    /// Creates the objects (`input_bytes` for inputs, `output_size` per model output) and
    /// registers them with the server.
    pub async fn create(
        client: &Client,
        input_bytes: u64,
        outputs: &[(String, Vec<TensorSpec>)],
        output_size: u64,
    ) -> Result<ShmRun, ClientError> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let tag = format!("nereid_perf_{}_{nanos:x}", std::process::id());
        let mut output_slots = Vec::new();
        for (model, specs) in outputs {
            for spec in specs {
                output_slots.push(((model.clone(), spec.name.clone()), output_slots.len() as u64 * output_size));
            }
        }
        let output_bytes = (output_slots.len() as u64 * output_size).max(ALIGN);
        let invalid = ClientError::Invalid;
        let input = Object::create(&format!("/{tag}_in"), input_bytes).map_err(invalid)?;
        let output = Object::create(&format!("/{tag}_out"), output_bytes).map_err(invalid)?;
        let mut run = ShmRun {
            input,
            output,
            input_region: format!("{tag}_in"),
            output_region: format!("{tag}_out"),
            cursor: 0,
            output_slots,
            output_size,
            registered: Vec::new(),
        };
        for (region, object) in [(&run.input_region, &run.input), (&run.output_region, &run.output)] {
            if let Err(e) = client.register_system_shm(region, &object.key, object.size).await {
                // Leave nothing registered behind.
                for done in &run.registered {
                    let _ = client.unregister_system_shm(done).await;
                }
                return Err(e);
            }
            run.registered.push(region.clone());
        }
        Ok(run)
    }

    /// Writes one request's inputs into the input object; with `outputs` (its model's), where
    /// the server is to write them.
    pub fn place(
        &mut self,
        model: &str,
        inputs: &[InputTensor],
        outputs: &[TensorSpec],
    ) -> Result<ShmRequest, ClientError> {
        let mut request = ShmRequest::default();
        for input in inputs {
            let len = input.data.len() as u64;
            if self.cursor + len > self.input.size {
                return Err(ClientError::Invalid(format!(
                    "input '{}' does not fit the shared memory laid out for this run",
                    input.name
                )));
            }
            self.input.write_at(self.cursor, &input.data).map_err(ClientError::Invalid)?;
            request.inputs.push(ShmSlice { region: self.input_region.clone(), offset: self.cursor, byte_size: len });
            self.cursor += len.div_ceil(ALIGN) * ALIGN;
        }
        for spec in outputs {
            if let Ok(offset) = self.slot(model, &spec.name) {
                let slice = ShmSlice { region: self.output_region.clone(), offset, byte_size: self.output_size };
                request.outputs.push((spec.name.clone(), slice));
            }
        }
        Ok(request)
    }

    /// The first `len` bytes of `model`'s `output` slot, as the server last wrote them (the
    /// generator never reads them; for checking a server's answers).
    pub fn read_output(&self, model: &str, output: &str, len: usize) -> Result<Vec<u8>, String> {
        let offset = self.slot(model, output)?;
        let mut buf = vec![0u8; len.min(self.output_size as usize)];
        // SAFETY: pread into a live buffer of its length from our own descriptor.
        let n = unsafe {
            libc::pread(self.output.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), offset as libc::off_t)
        };
        if n != buf.len() as isize {
            return Err(os_error("cannot read the output shared memory"));
        }
        Ok(buf)
    }

    /// Zeroes `model`'s `output` slot.
    pub fn clear_output(&self, model: &str, output: &str) -> Result<(), String> {
        self.output.write_at(self.slot(model, output)?, &vec![0u8; self.output_size as usize])
    }

    /// Where `model`'s `output` slot starts in the output object.
    fn slot(&self, model: &str, output: &str) -> Result<u64, String> {
        self.output_slots
            .iter()
            .find(|((m, o), _)| m == model && o == output)
            .map(|(_, offset)| *offset)
            .ok_or_else(|| format!("no shared memory slot for {model}/{output}"))
    }

    /// Unregisters the regions (best effort: the server may be gone); the objects are unlinked
    /// when `self` drops.
    pub async fn release(mut self, client: &Client) -> Vec<String> {
        let mut errors = Vec::new();
        for region in std::mem::take(&mut self.registered) {
            if let Err(e) = client.unregister_system_shm(&region).await {
                errors.push(format!("unregistering shared memory region '{region}': {e}"));
            }
        }
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_common::DataType;

    fn tensor(name: &str, n: usize) -> InputTensor {
        InputTensor {
            name: name.into(),
            datatype: DataType::Uint8,
            shape: vec![n as i64],
            data: (0..n as u8).collect(),
        }
    }

    #[test]
    fn layout_is_aligned_and_sized() {
        let a = [tensor("A", 10), tensor("B", 64)];
        let b = [tensor("A", 65)];
        assert_eq!(ShmRun::input_bytes([&a[..], &b[..]]), 64 + 64 + 128);
        assert_eq!(ShmRun::input_bytes(std::iter::empty::<&[InputTensor]>()), 64);
    }

    #[test]
    fn objects_hold_what_was_written_and_are_unlinked_on_drop() {
        let key = format!("/nereid_perf_test_{}", std::process::id());
        let object = Object::create(&key, 256).unwrap();
        object.write_at(100, b"hello").unwrap();
        let mut buf = [0u8; 5];
        let n = unsafe { libc::pread(object.fd.as_raw_fd(), buf.as_mut_ptr().cast(), 5, 100) };
        assert_eq!((n, &buf), (5, b"hello"));
        assert!(Object::create(&key, 16).unwrap_err().contains("cannot create"), "O_EXCL: never reuses a name");
        drop(object);
        let c = CString::new(key.clone()).unwrap();
        assert!(unsafe { libc::shm_open(c.as_ptr(), libc::O_RDONLY, 0) } < 0, "unlinked on drop");
    }
}
