//! Non-tensor state gives back what was saved: every JSON value a rank or the job
//! sets comes back from a commit equal, floats to the bit (a learning rate, a loss
//! scale, a moving average), integers to the full 64 bits.
//!
//! The values go through the whole path a checkpoint takes: the rank part written
//! with its envelope, the commit, and the reader's parse of the part.

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, DType, State, as_bytes};
use proptest::prelude::*;
use serde_json::{Value, json};

/// Saves one rank holding `rank_values` as its own state and `global_values` as the
/// job's, commits, and reads both back.
async fn round_trip(rank_values: &[Value], global_values: &[Value]) -> (Vec<Value>, Vec<Value>) {
    // A store of its own: memory stores of one name are shared within the process.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let store = Store::from_url(&format!("memory://state-values-{n}")).unwrap();
    let checkpointer = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    let weights = [1.0f32, 2.0];
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, &[2], 0, 1, as_bytes(&weights))
        .unwrap();
    for (i, v) in rank_values.iter().enumerate() {
        state.set_rank_json(format!("r{i:06}"), v.clone());
    }
    for (i, v) in global_values.iter().enumerate() {
        state.set_global_json(format!("g{i:06}"), v.clone());
    }
    checkpointer
        .save(1, &state)
        .await
        .unwrap()
        .committed()
        .await
        .unwrap();
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let ranks = reader.rank_states().await.unwrap();
    let json_of = |v: &ckpt::StateValue| v.as_json().expect("a JSON value").clone();
    let rank = ranks[0].1.values().map(json_of).collect();
    let global = reader
        .global_state()
        .await
        .unwrap()
        .values()
        .map(json_of)
        .collect();
    (rank, global)
}

fn bits(values: &[Value]) -> Vec<u64> {
    values
        .iter()
        .map(|v| v.as_f64().expect("a float").to_bits())
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn floats_come_back_to_the_bit() {
    // Values whose shortest decimal needs all 17 digits, subnormals, the extremes,
    // and negative zero: the cases a best-effort float parser rounds wrongly.
    let mut floats = vec![
        0.1,
        -0.0,
        f64::MIN_POSITIVE,
        f64::MAX,
        f64::MIN,
        f64::EPSILON,
        5e-324,
        f64::from_bits(0x000F_FFFF_FFFF_FFFF), // the largest subnormal
        1.0000000000000002,
        0.30000000000000004,
        9007199254740993.0,
        1e23,
        8.41e21,
    ];
    // And many drawn from every part of the range (a fixed stream: the failure of one
    // names its bits).
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    while floats.len() < 20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let f = f64::from_bits(x);
        if f.is_finite() {
            floats.push(f);
        }
    }
    let values: Vec<Value> = floats.iter().map(|&f| json!(f)).collect();
    let (rank, global) = runtime().block_on(round_trip(&values, &values[..100]));
    let expected = bits(&values);
    let changed: Vec<String> = bits(&rank)
        .iter()
        .zip(&expected)
        .filter(|(got, want)| got != want)
        .take(5)
        .map(|(got, want)| format!("{want:#018x} came back as {got:#018x}"))
        .collect();
    assert!(changed.is_empty(), "floats changed: {changed:?}");
    assert_eq!(bits(&global), expected[..100]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Integers to the full range of i64 and u64, strings, booleans, null, nested
    /// arrays and objects: equal after the round trip.
    #[test]
    fn json_values_come_back_equal(
        ints in prop::collection::vec(any::<i64>(), 0..8),
        uints in prop::collection::vec(any::<u64>(), 0..8),
        floats in prop::collection::vec(any::<f64>().prop_filter("finite", |f| f.is_finite()), 0..8),
        text in ".{0,24}",
        flag in any::<bool>(),
    ) {
        let value = json!({
            "ints": ints,
            "uints": uints,
            "floats": floats,
            "text": text,
            "flag": flag,
            "none": null,
            "nested": [[text.clone(), {"k": ints.clone()}], []],
        });
        let (rank, global) = runtime().block_on(round_trip(
            std::slice::from_ref(&value),
            std::slice::from_ref(&value),
        ));
        prop_assert_eq!(&rank[0], &value);
        prop_assert_eq!(&global[0], &value);
    }
}
