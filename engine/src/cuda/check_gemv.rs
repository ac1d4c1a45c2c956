//! `kernels --check`'s GEMV families: every compiled one-token GEMV variant (x-stationary and
//! warp-rows, the default selection), the integer form on extreme and non-finite x, x limbs from
//! the op before, several products in one launch, and the q/k/v launch with RoPE and the KV
//! append in its store; each against the CPU engine (the table is `CudaBackend::CHECKS` in
//! `check.rs`).

use super::*;

impl CudaBackend {
    /// Every x-stationary GEMV variant (`GEMV` cases).
    pub(super) fn check_gemv_xs(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let rows = 37;
        // Every compiled x-stationary GEMV variant, on shapes whose rows end in a partial warp of
        // units and whose row count is not a multiple of R.
        for ty in [
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_1,
            GgmlType::Q4K,
        ] {
            let cols = match ty {
                GgmlType::Q8_0 => 768,
                // 19 pairs of blocks: 76 units, a partial second warp.
                GgmlType::Q4_1 => 1216,
                GgmlType::Q4K => 1280,
                _ => 1032,
            };
            let bytes = test_bytes(ty, rows, cols, 40 + ty as u64);
            let w = test_weight(ty, &bytes, rows, cols);
            let x = noise(cols, 41);
            let mut c = CpuBackend.alloc(rows);
            CpuBackend.linear(&Buf::host(x.clone()), 1, w, &mut c);
            let c = c.as_host().to_vec();
            let xd = self.upload(&x);
            for v in GEMV_VARIANTS.iter().filter(|v| v.ty == ty && v.kind == GemvKind::Xs) {
                let mut g = self.upload(&vec![f32::NAN; rows]);
                self.linear_with(&xd, 1, w, &mut g, Some(*v));
                out.push(compare(
                    format!(
                        "GEMV(type={},ne=[{cols},{rows}],variant={})",
                        type_suffix(ty).unwrap_or("?"),
                        v.entry()
                    ),
                    &self.download(&g),
                    &c,
                    1e-5,
                ));
            }
            self.weights.lock().expect("weight map").clear();
        }
        out
    }

    /// Every warp-rows GEMV variant and the default selection (`GEMV` cases).
    pub(super) fn check_gemv_rows(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // Every warp-rows GEMV variant, x in shared memory or not, and every tensor-core one (and
        // the default selection), on shapes that end in a
        // partial chunk of 32 units, a partial last step of NW·32·U units, chunks wholly past the
        // end (skipped), rows not a multiple of R and fewer rows than R; Q4_K from 1 to 70
        // super-blocks per row, Q4_1 with even block counts (smollm2's widths among them).
        let wr_shapes: [(GgmlType, &[(usize, usize)]); 6] = [
            // Units: 8 (one partial chunk), 40, 152, 456, 560 (two steps at NW 4, U 4); pair units
            // (mode 3): 4, 20, 76, 228, 280 (3 to 9 chunks: two steps at NW 7, four at NW 2).
            (
                GgmlType::Q4K,
                &[(256, 37), (1280, 37), (4864, 37), (14592, 3), (17920, 37)],
            ),
            // Units: 4, 36, 96, 76, 524 (a partial chunk after 512).
            (
                GgmlType::Q4_1,
                &[(64, 37), (576, 37), (1536, 7), (1216, 37), (8384, 37)],
            ),
            // Units: 16, 48, 272.
            (GgmlType::Q8_0, &[(256, 37), (768, 3), (4352, 37)]),
            // Units: 1, 129, 257.
            (GgmlType::F16, &[(8, 37), (1032, 37), (2056, 3)]),
            (GgmlType::BF16, &[(8, 5), (1032, 37), (2056, 37)]),
            // Units: 64, 128, 448 (3.5 steps at NW 4, U 1): rows of a multiple of 8 super-blocks.
            (GgmlType::Q6K, &[(2048, 37), (4096, 3), (14336, 37)]),
        ];
        for (ty, shapes) in wr_shapes {
            for &(cols, rows) in shapes {
                let bytes = test_bytes(ty, rows, cols, 50 + ty as u64 + cols as u64);
                let w = test_weight(ty, &bytes, rows, cols);
                let x = noise(cols, 51 + cols as u64);
                let mut c = CpuBackend.alloc(rows);
                CpuBackend.linear(&Buf::host(x.clone()), 1, w, &mut c);
                let c = c.as_host().to_vec();
                let xd = self.upload(&x);
                let name = type_suffix(ty).unwrap_or("?");
                let wr = GEMV_VARIANTS
                    .iter()
                    .filter(|v| v.ty == ty && v.kind != GemvKind::Xs && self.gemv_fits(**v, cols))
                    .map(|v| (Some(*v), v.entry()));
                let default = (
                    None,
                    format!(
                        "default={}",
                        self.gemv_default(ty, rows, cols).map_or("matvec".into(), |v| v.entry())
                    ),
                );
                for (v, label) in wr.chain([default]) {
                    let mut g = self.upload(&vec![f32::NAN; rows]);
                    self.linear_with(&xd, 1, w, &mut g, v);
                    out.push(compare(
                        Case::new("GEMV")
                            .p("type", name)
                            .p("ne", format!("[{cols},{rows}]"))
                            .p("variant", label)
                            .to_string(),
                        &self.download(&g),
                        &c,
                        1e-5,
                    ));
                }
                self.weights.lock().expect("weight map").clear();
            }
        }
        out
    }

    /// The integer form on x of extreme magnitudes and non-finite x (`GEMV` cases).
    pub(super) fn check_gemv_int_extremes(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // The integer form (modes 2 and 3) on x of very different magnitudes (×1e4, ×1e-30, and
        // mixed within a block of 32 with zeros: the limbs carry each x to 2^-22 of its block's
        // max), and on x with a NaN or an inf: the output is non-finite exactly where the CPU
        // engine's is. (Not below ~5e-32: there a block's scale is subnormal, see gemv.cu.)
        for (ty, cols, rows) in [
            (GgmlType::Q4K, 1280, 37),
            (GgmlType::Q4_1, 1216, 37),
            (GgmlType::Q8_0, 768, 37),
            (GgmlType::Q6K, 2048, 37),
        ] {
            let bytes = test_bytes(ty, rows, cols, 70 + ty as u64);
            let w = test_weight(ty, &bytes, rows, cols);
            let name = type_suffix(ty).unwrap_or("?");
            for kind in ["x1e4", "x1e-30", "mixed", "nan", "inf"] {
                let mut x = scaled_test_x(kind, cols, 71);
                match kind {
                    "nan" => x[cols / 2] = f32::NAN,
                    "inf" => x[cols / 3] = f32::INFINITY,
                    _ => {}
                }
                let mut c = CpuBackend.alloc(rows);
                CpuBackend.linear(&Buf::host(x.clone()), 1, w, &mut c);
                let c = c.as_host().to_vec();
                let xd = self.upload(&x);
                for v in GEMV_VARIANTS
                    .iter()
                    .filter(|v| v.ty == ty && v.takes_limbs() && self.gemv_fits(**v, cols))
                {
                    let mut g = self.upload(&vec![0.0; rows]);
                    self.linear_with(&xd, 1, w, &mut g, Some(*v));
                    let g = self.download(&g);
                    let case = Case::new("GEMV")
                        .p("type", name)
                        .p("ne", format!("[{cols},{rows}]"))
                        .p("x", kind)
                        .p("variant", v.entry())
                        .to_string();
                    out.push(if kind == "nan" || kind == "inf" {
                        let same = g.len() == c.len() && g.iter().zip(&c).all(|(a, b)| a.is_finite() == b.is_finite());
                        KernelCheck {
                            pass: same && c.iter().any(|v| !v.is_finite()),
                            ..compare(case, &[], &[], 0.0)
                        }
                    } else {
                        compare(case, &g, &c, 1e-5)
                    });
                }
            }
            self.weights.lock().expect("weight map").clear();
        }
        out
    }

    /// X limbs written by the op before the GEMV (`GEMV_LIMBS` cases).
    pub(super) fn check_gemv_limbs(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // The limbs a decode row's RMSNorm, add+RMSNorm, SwiGLU or GQA attention (the split kernel,
        // 32/8 heads of 128 over 300 positions) writes beside it (DevBuf::limbs): the GEMV that
        // reads them (the default, and the pair units' R 4 variant) gives bit for bit what it gives
        // after its own pre-pass, and a later write to the row (an add) drops them, so the next
        // GEMV sees the new values.
        let pair = GEMV_VARIANTS
            .iter()
            .copied()
            .find(|v| v.mode == 3 && v.r == 4 && v.nw == pair_nw(4096));
        for force in [None, pair] {
            let (ty, d, rows) = (GgmlType::Q4K, 4096, 37);
            let bytes = test_bytes(ty, rows, d, 90);
            let w = test_weight(ty, &bytes, rows, d);
            let (x, a, wn) = (noise(d, 91), noise(d, 92), noise(d, 93));
            let expect = self.limbs_out(d, d).is_some();
            let gemv = |b: &Buf| {
                let mut o = self.alloc(rows);
                self.linear_with(b, 1, w, &mut o, force);
                self.download(&o)
            };
            let attn_shape = GqaShape {
                window: None,
                softcap: None,
                n_heads: 32,
                n_kv_heads: 8,
                head_dim: d / 32,
                scale: 1.0 / ((d / 32) as f32).sqrt(),
            };
            let ctx = 300;
            let (kc, vc) = (noise(ctx * d / 4, 94), noise(ctx * d / 4, 95));
            let label = force.map_or(String::new(), |v| format!(",variant={}", v.entry()));
            for producer in ["rms_norm", "add_rms_norm", "swiglu", "gqa_attention"] {
                let expect = expect && (producer != "gqa_attention" || self.attn_split_plan(attn_shape).is_some());
                let mut row = self.alloc(d);
                match producer {
                    "gqa_attention" => {
                        let (kd, vd) = (self.upload(&kc), self.upload(&vc));
                        self.gqa_attention(&self.upload(&x), &kd, &vd, ctx - 1, attn_shape, &mut row)
                    }
                    "rms_norm" => self.rms_norm(&self.upload(&x), &wn, 1e-5, &mut row),
                    "add_rms_norm" => {
                        self.add_rms_norm(&mut self.upload(&x), &self.upload(&a), false, &wn, 1e-5, &mut row)
                    }
                    _ => {
                        row = self.upload(&x);
                        self.swiglu(&mut row, &self.upload(&a));
                    }
                }
                let had = limbs_of(&row, d).is_some();
                let (g1, g2) = (gemv(&row), gemv(&self.upload(&self.download(&row))));
                self.add_assign(&mut row, &self.upload(&a), false);
                let dropped = limbs_of(&row, d).is_none();
                let (g3, g4) = (gemv(&row), gemv(&self.upload(&self.download(&row))));
                let same = |p: &[f32], q: &[f32]| p.iter().zip(q).all(|(u, v)| u.to_bits() == v.to_bits());
                out.push(KernelCheck {
                    pass: had == expect && dropped && same(&g1, &g2) && same(&g3, &g4),
                    ..compare(
                        Case::new("GEMV_LIMBS")
                            .p("producer", producer)
                            .p("type", "q4_k")
                            .p("ne", format!("[{d},{rows}]"))
                            .p("fused", format!("{had}{label}"))
                            .to_string(),
                        &g1,
                        &g2,
                        0.0,
                    )
                });
            }
            self.weights.lock().expect("weight map").clear();
        }
        out
    }

    /// Several products of one token in one warp-rows launch (`MUL_MAT_MANY` cases).
    pub(super) fn check_gemv_multi(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // Several products of one token in one warp-rows launch (q/k/v, gate/up): row counts that
        // split R-row blocks between matrices, then outputs back to back.
        for (ty, cols, rows_each) in [
            (GgmlType::Q4K, 512usize, vec![37usize, 5, 12]),
            (GgmlType::Q4_1, 576, vec![9, 40]),
            (GgmlType::Q8_0, 256, vec![3, 3, 64]),
        ] {
            let bytes: Vec<Vec<u8>> = (rows_each.iter().enumerate())
                .map(|(i, &r)| test_bytes(ty, r, cols, 80 + i as u64))
                .collect();
            let ws: Vec<WeightRef> = bytes
                .iter()
                .zip(&rows_each)
                .map(|(b, &r)| test_weight(ty, b, r, cols))
                .collect();
            let x = noise(cols, 90);
            let (g, c) = both(self, |be| {
                let mut os: Vec<Buf> = rows_each.iter().map(|&r| be.alloc(r)).collect();
                let mut refs: Vec<&mut Buf> = os.iter_mut().collect();
                be.linear_many(&be.upload(&x), 1, &ws, &mut refs);
                os.iter().flat_map(|o| be.download(o)).collect()
            });
            out.push(compare(
                format!(
                    "MUL_MAT_MANY(type={},cols={cols},rows={rows_each:?},n=1)",
                    type_suffix(ty).unwrap_or("?")
                ),
                &g,
                &c,
                1e-5,
            ));
            self.weights.lock().expect("weight map").clear();
        }
        out
    }

    /// Q/k/v with RoPE and the KV append in the GEMV store (`MUL_MAT_QKV_ROPE` cases).
    pub(super) fn check_qkv_rope(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // q/k/v with RoPE and the KV-cache append in the GEMV's store (linear_qkv_rope), after 7
        // cached rows: against the CPU engine, and bit for bit against the GPU's separate launches
        // (linear_many, rope_qk_cache). Q4_K rows of 4096 (the integer GEMV) with whole-head RoPE,
        // of 512 (the float GEMV) with a partial one; NEOX takes the separate launches. A Q6_K v
        // (Q4_K_M's promoted layers): at 4096 a q + k launch and a v launch share the store, at
        // 512 (no warp-rows Q6_K) the separate launches run.
        // Each also with Llama 3.1+'s per-pair frequency factors (`freqs=llama3`): the store's
        // angle table is the rope kernels' one.
        for ((cols, hd, dim, style, v_ty, want_split), scaled) in [
            (4096usize, 64usize, 64usize, RopeStyle::Norm, GgmlType::Q4K, false),
            (512, 48, 32, RopeStyle::Norm, GgmlType::Q4K, false),
            (512, 32, 32, RopeStyle::Neox, GgmlType::Q4K, false),
            (4096, 64, 64, RopeStyle::Norm, GgmlType::Q6K, true),
            (4096, 128, 128, RopeStyle::Norm, GgmlType::Q6K, true),
            (512, 48, 32, RopeStyle::Norm, GgmlType::Q6K, false),
        ]
        .into_iter()
        .flat_map(|c| [(c, false), (c, true)])
        {
            let factors = super::check::llama3_factors(dim, 10000.0);
            let (qh, kh, pos0) = (4usize, 2usize, 7usize);
            let rows = [qh * hd, kh * hd, kh * hd];
            let tys = [GgmlType::Q4K, GgmlType::Q4K, v_ty];
            let bytes = [0, 1, 2].map(|i| test_bytes(tys[i], rows[i], cols, 95 + i as u64));
            let ws = [0, 1, 2].map(|i| test_weight(tys[i], &bytes[i], rows[i], cols));
            let x = noise(cols, 98);
            let (old_k, old_v) = (noise(pos0 * rows[1], 99), noise(pos0 * rows[2], 100));
            let layout = |heads| RopeLayout {
                n_heads: heads,
                head_stride: hd,
                offset: 0,
                rope_dim: dim,
            };
            let rope = QkRope {
                q: layout(qh),
                k: layout(kh),
                pos0,
                base: 10000.0,
                style,
                freqs: if scaled {
                    RopeFreqs {
                        divisor: 1.0,
                        factors: Some(&factors),
                    }
                } else {
                    RopeFreqs::default()
                },
            };
            let run = |be: &dyn Backend, fused: bool| {
                let xb = be.upload(&x);
                let [mut q, mut k, mut v] = rows.map(|r| be.alloc(r));
                let (mut kc, mut vc) = (Buf::default(), Buf::default());
                be.kv_write(&mut kc, &be.upload(&old_k), rows[1], 0, 0);
                be.kv_write(&mut vc, &be.upload(&old_v), rows[2], 0, 0);
                if fused {
                    be.linear_qkv_rope(&xb, 1, ws, [&mut q, &mut k, &mut v], rope, [&mut kc, &mut vc]);
                } else {
                    be.linear_many(&xb, 1, &ws, &mut [&mut q, &mut k, &mut v]);
                    be.rope_qk_cache(&mut q, &mut k, &v, rows[2], rope, [&mut kc, &mut vc]);
                }
                [&q, &k, &v, &kc, &vc]
                    .iter()
                    .flat_map(|b| be.download(b))
                    .collect::<Vec<f32>>()
            };
            let ty = if v_ty == GgmlType::Q4K { "q4_k" } else { "q4_k+q6_k" };
            let mut case = Case::new("MUL_MAT_QKV_ROPE")
                .p("type", ty)
                .p("cols", cols)
                .p("hd", hd)
                .p("dim", dim)
                .p("style", format!("{style:?}"))
                .p("pos0", pos0);
            if scaled {
                case = case.p("freqs", "llama3");
            }
            let case = case.to_string();
            let (g, c) = both(self, |be| run(be, true));
            out.push(compare(case.clone(), &g, &c, 1e-5));
            out.push(compare(format!("{case}_VS_SEPARATE"), &g, &run(self, false), 0.0));
            // The q + k and v launches are taken where expected (the cases above pass either way).
            let split = self.qk_then_v(&ws.map(|w| self.weight(w, &self.stream)), &ws).is_some();
            if split != want_split {
                out.push(KernelCheck {
                    case: format!("{case}_QK_THEN_V(taken={split})"),
                    rel_l2: f64::NAN,
                    max_abs: f64::NAN,
                    tol: 0.0,
                    pass: false,
                });
            }
            self.weights.lock().expect("weight map").clear();
            // The angle table's key names this iteration's factors by address.
            *self.rope_table.lock().expect("rope table") = None;
        }
        out
    }
}
