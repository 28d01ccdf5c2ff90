//! The body of `POST /v1/tasks` (one envelope or an array): either every envelope is accepted
//! and re-encodes within the limit, or the answer is a 400 with a code and, for an array, the
//! index of a bad envelope inside it.
#![no_main]

use libfuzzer_sys::fuzz_target;

const MAX: usize = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    match fleet::task::parse_body(data, &fleet::task::Limits { max_bytes: MAX, ..Default::default() }, 5, chrono::Utc::now()) {
        Ok(envs) => {
            assert!(!envs.is_empty());
            for e in &envs {
                assert!(fleet::Envelope::from_slice(&e.envelope.to_bytes(), usize::MAX).is_ok());
            }
        }
        Err(b) => assert!(!b.code.is_empty()),
    }
});
