#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kiln_fuzz::kv_events_socket(data));
