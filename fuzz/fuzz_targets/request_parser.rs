//! Arbitrary bytes as a `/v1/systemone` request body. Parsing either succeeds or gives an error whose
//! status is 400 or 422 and whose body serializes; a request that parses also renders (or is refused
//! with an API error, never a panic). The Python-compatible JSON layer must round-trip what it accepts.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prism_decision::pyjson;
use prism_decision::{render_request, DecisionConfig, DecisionRequest, RequestDefaults};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(value) = pyjson::parse(text) {
            let printed = pyjson::dumps(&value);
            let again = pyjson::parse(&printed).expect("dumps output parses");
            assert_eq!(pyjson::dumps(&again), printed, "dumps is a fixed point");
        }
    }
    match DecisionRequest::parse(data, &RequestDefaults::default()) {
        Ok(request) => {
            if let Err(error) = render_request(&request, &DecisionConfig::default()) {
                assert!(matches!(error.status(), 400 | 422), "render refused with {}", error.status());
                serde_json::to_string(&error.body()).expect("error body serializes");
            }
        }
        Err(error) => {
            assert!(matches!(error.status(), 400 | 422), "parse refused with {}", error.status());
            serde_json::to_string(&error.body()).expect("error body serializes");
        }
    }
});
