//! Label selectors (`k=v,k=v`, as in `FLEET_LABELS`): never panic; a parsed selector's group
//! name parses back to the same labels.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(labels) = fleet::Labels::parse(text) {
        let name = labels.group_name();
        let again = fleet::Labels::parse(&labels.pairs().join(",")).expect("pairs re-parse");
        assert_eq!(again.group_name(), name);
        assert!(labels.satisfies(&fleet::Labels::new()));
        assert!(labels.satisfies(&labels));
    }
});
