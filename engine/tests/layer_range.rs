//! `EngineOptions::layers` (issue 49): an engine over layers A..B loads only those layers, starts
//! from a residual handed to `prefill_from`, and ends with the head only when B is the last
//! layer: layers 0..A then A..N give the whole model's logits bit for bit (CPU, TP 1 and 2).

mod common;

use common::*;
use engine::fault::FaultSet;
use engine::weights::Loader;
use engine::{Engine, EngineError, EngineOptions};
use references::tap::NoTap;
use references::{GgmlType, ModelConfig};

const N_LAYERS: usize = 4;

fn model() -> Model {
    synth(
        &spec("llama-tiny", GgmlType::Q8_0, |s| s.config.n_layers = N_LAYERS),
        49,
    )
}

fn opts(tp: usize, layers: Option<std::ops::Range<usize>>) -> EngineOptions {
    EngineOptions {
        tp,
        layers,
        ..EngineOptions::default()
    }
}

#[test]
fn a_split_run_gives_the_whole_models_logits() {
    let m = model();
    let c = ModelConfig::from_header(&m.file.header).unwrap();
    let toks = tokens(6, c.vocab, 3);
    for tp in [1, 2] {
        let whole = Engine::load(&m.file, opts(tp, None))
            .unwrap()
            .prefill(&toks, &mut NoTap)
            .unwrap();
        let mut head = Engine::load(&m.file, opts(tp, Some(0..2))).unwrap();
        let residual = head.prefill(&toks, &mut NoTap).unwrap();
        assert_eq!(residual.len(), toks.len() * c.d_model, "no head: the residual");
        let mut tail = Engine::load(&m.file, opts(tp, Some(2..N_LAYERS))).unwrap();
        let logits = tail.prefill_from(&toks, &residual, &mut NoTap).unwrap();
        assert_eq!(logits, whole, "tp {tp}");
        // A range engine takes no decode, no tokens-only step and no residual of the wrong size.
        assert!(matches!(tail.decode(toks[0], &mut NoTap), Err(EngineError::Options(_))));
        assert!(tail.prefill(&toks, &mut NoTap).is_err());
        assert!(tail.prefill_from(&toks, &residual[1..], &mut NoTap).is_err());
    }
}

#[test]
fn a_range_loads_only_its_layers_and_bad_ranges_are_refused() {
    let m = model();
    let mut c = ModelConfig::from_header(&m.file.header).unwrap();
    c.n_layers = 3;
    let faults = FaultSet::new(Vec::new());
    let shard = Loader::new(&m.file, &c, &faults, 1, Default::default())
        .first_layer(1)
        .load_rank(0)
        .unwrap();
    assert_eq!((shard.layers.first, shard.layers.shards.len()), (1, 2));
    for bad in [2..2, std::ops::Range { start: 3, end: 2 }, 0..N_LAYERS + 1] {
        let e = Engine::load(&m.file, opts(1, Some(bad.clone()))).err();
        assert!(matches!(e, Some(EngineError::Options(_))), "{bad:?}");
    }
    let both = EngineOptions {
        n_layers: Some(2),
        ..opts(1, Some(0..2))
    };
    assert!(Engine::load(&m.file, both).is_err());
}
