//! Process limits a server raises for itself at start.

/// Raises this process's soft limit on open files to its hard limit, as Go's runtime and most
/// servers do: the soft limit is often 1024 (systemd's default, recent container runtimes),
/// while every client connection, upstream connection and registered shared-memory region holds
/// a descriptor — 1024 of them and the server could accept no connection and load no model.
/// Returns the (old, new) soft limits, or the reason it could not.
pub fn raise_open_files_limit() -> Result<(u64, u64), String> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct it is given; RLIMIT_NOFILE is a valid resource.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    let old = limit.rlim_cur;
    if limit.rlim_cur >= limit.rlim_max {
        return Ok((old, old));
    }
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: setrlimit reads the struct; a soft limit up to the hard one needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    Ok((old, limit.rlim_cur))
}

/// The (soft, hard) open-files limits of process `pid`, read from `/proc/<pid>/limits`
/// (`None` where it cannot be read; `u64::MAX` stands for "unlimited").
pub fn open_files_limits_of(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    let mut fields = line["Max open files".len()..].split_whitespace();
    let value = |v: &str| if v == "unlimited" { Some(u64::MAX) } else { v.parse().ok() };
    Some((value(fields.next()?)?, value(fields.next()?)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The soft limit ends at the hard one (raised, or already there), and a second call
    /// changes nothing.
    #[test]
    fn the_soft_limit_reaches_the_hard_one() {
        let (_, new) = raise_open_files_limit().expect("raised");
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        assert_eq!((limit.rlim_cur, new), (limit.rlim_max, limit.rlim_max));
        assert_eq!(raise_open_files_limit().unwrap(), (new, new));
        assert_eq!(open_files_limits_of(std::process::id()), Some((new, limit.rlim_max)));
    }
}
