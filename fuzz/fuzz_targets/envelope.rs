//! Envelope parsing and validation: any bytes from the broker either parse into an envelope
//! that survives normalisation and a re-encode round trip, or are refused with a reason code.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let now = chrono::Utc::now();
    if let Ok(mut env) = fleet::Envelope::parse(data, &fleet::task::Limits::default()) {
        if env.normalize(now, 5).is_ok() {
            // What the scheduler forwards must parse again as the same task.
            let again = fleet::Envelope::from_slice(&env.to_bytes(), usize::MAX).expect("a normalised envelope re-parses");
            assert_eq!(again.id, env.id);
            assert_eq!(again.kind, env.kind);
            let _ = env.selector().group_name();
        }
    }
});
