//! Settings: a config file's text (TOML) and environment-style `KEY=value` lines go through
//! every binary's config reader; bad values must come back as errors naming a setting, never
//! a panic. Keys naming files are dropped (the fuzzer must not read /dev/zero or the disk).
//! Every declaration (common, scheduler, worker: all in the fleet lib) and the common checks
//! always; the scheduler's and the worker's relation checks (`from_settings`) with the cargo
//! feature `binaries` (`ops/fuzz.sh --binaries`), which builds those two crates too.
#![no_main]

use fleet::settings::Settings;
use libfuzzer_sys::fuzz_target;

fn check(s: &Settings) {
    let results = [
        fleet::settings::CommonConfig::from_settings(s, "127.0.0.1:0").map(|_| ()),
        #[cfg(not(feature = "binaries"))]
        fleet::settings::parse::<fleet::settings::SchedulerArgs>(s).map(|_| ()),
        #[cfg(not(feature = "binaries"))]
        fleet::settings::parse::<fleet::settings::WorkerArgs>(s).map(|_| ()),
        #[cfg(feature = "binaries")]
        fleet_scheduler::SchedulerConfig::from_settings(s).map(|_| ()),
        #[cfg(feature = "binaries")]
        fleet_worker::WorkerConfig::from_settings(s).map(|_| ()),
    ];
    for r in results {
        if let Err(e) = r {
            assert!(e.to_string().contains("FLEET_"), "error names no setting: {e}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    // As a config file.
    if let Ok(mut s) = Settings::from_toml(text) {
        for key in ["config", "api_tokens_file", "amqp_tls_ca_file", "amqp_tls_cert_file", "amqp_tls_key_file", "redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file", "http_tls_ca_file", "http_tls_cert_file", "http_tls_key_file"] {
            s.set(key, "");
        }
        check(&s);
    }
    // As environment lines.
    let pairs: Vec<(&str, String)> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| !k.to_ascii_lowercase().ends_with("_file") && !k.eq_ignore_ascii_case("config"))
        .map(|(k, v)| (k, v.to_string()))
        .collect();
    check(&Settings::from_pairs(pairs));
});
