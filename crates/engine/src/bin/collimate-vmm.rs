//! The VMM process for Rust callers (tests, benchmarks): serves the channel on fd 3.
//! Python callers start a Python interpreter that calls the same entry point instead.
fn main() {
    collimate_engine::vmm::serve_fd(3)
}
