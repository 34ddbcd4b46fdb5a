//! Compiles the etcd KV subset with protox (pure Rust, no protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/etcd_kv.proto");
    let fds = protox::compile(["proto/etcd_kv.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
