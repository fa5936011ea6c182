//! A byte-copying TCP relay: the floor under any proxy's cost on a machine. The gateway
//! benchmark puts it between perf_analyzer and the worker to measure what one more loopback
//! hop and one more process cost by themselves (no HTTP/2, no routing), next to the gateway.
//!
//! `cargo run --release -p nereid-gateway --example tcp_relay -- LISTEN_PORT_FILE UPSTREAM`
//! listens on an ephemeral loopback port, writes it to LISTEN_PORT_FILE, and relays every
//! connection to UPSTREAM (`HOST:PORT`) on one event-loop thread (as the gateway's default).

use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(port_file), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: tcp_relay LISTEN_PORT_FILE UPSTREAM_HOST:PORT");
        std::process::exit(2);
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let tmp = format!("{port_file}.tmp");
        std::fs::write(&tmp, listener.local_addr()?.port().to_string())?;
        std::fs::rename(&tmp, &port_file)?;
        loop {
            let (mut inbound, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    eprintln!("tcp_relay: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let mut outbound = match TcpStream::connect(&upstream).await {
                    Ok(s) => s,
                    Err(e) => {
                        eprintln!("tcp_relay: connect {upstream}: {e}");
                        return;
                    }
                };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    })
}
