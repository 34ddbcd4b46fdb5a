//! Compiles the engine's RPC service (segment descriptors for the P2P handshake) with protox.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/transfer.proto");
    let fds = protox::compile(["proto/transfer.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
