//! [`Backend`] for [`Cuda`]: memory moves and the launch of each operation's kernel. Shapes are
//! checked here, before any launch, against the views the model hands in.

use std::ops::Range;

use half::bf16;
use kiln_backend::quant::{dequantize_row, quantize_row};
use kiln_backend::{
    AttentionShape, Backend, ForwardError, GateActivation, GgmlType, HostTensor, KvCacheDtype,
    KvCacheSpec, LinearJob, LoadTensorError, Logits, RopeConfig, RopeStyle, SeqSpan,
};

use crate::Cuda;
use crate::kernels::{
    Arg, DECODE_THREADS, MAX_HEAD_DIM, PREFILL_MAX_HEAD_DIM, PREFILL_ROWS, PREFILL_THREADS,
    blocks_for, decode_split_keys, launch, norm_threads, row_grid,
};
use crate::memory::{
    CudaBuffer, CudaKvStore, CudaRope, CudaVector, CudaView, CudaViewMut, CudaWeight,
};
use crate::scratch::{Meta, grown};

fn grid1(n: usize) -> (u32, u32, u32) {
    (u32::try_from(n).unwrap_or_else(|_| panic!("grid of {n} blocks")), 1, 1)
}

fn to_u32(v: &[usize]) -> Vec<u32> {
    v.iter().map(|&x| x as u32).collect()
}

/// The f32 values of `tensor`, each row through `convert` when given (quantized and back, as
/// the reference backend does, so `--quantization` means the same values everywhere).
fn host_values(
    tensor: &HostTensor,
    convert: Option<GgmlType>,
) -> Result<Vec<f32>, LoadTensorError> {
    let (ty, rows, cols) = (tensor.ty(), tensor.rows(), tensor.cols());
    let mut out = vec![0.0f32; rows * cols];
    if cols == 0 || rows == 0 {
        return Ok(out);
    }
    let bytes = tensor.bytes().as_slice();
    let row_bytes = bytes.len() / rows;
    for (src, dst) in bytes.chunks_exact(row_bytes).zip(out.chunks_exact_mut(cols)) {
        dequantize_row(ty, src, dst);
    }
    if let Some(to) = convert.filter(|t| t.is_quantized()) {
        let qbytes = to.row_bytes(cols).ok_or(LoadTensorError::Convert {
            ty: to,
            cols,
            block: to.block_elems(),
        })?;
        let mut q = vec![0u8; qbytes];
        for row in out.chunks_exact_mut(cols) {
            quantize_row(to, row, &mut q);
            dequantize_row(to, &q, row);
        }
    }
    Ok(out)
}

impl Backend for Cuda {
    type Weight = CudaWeight;
    type Vector = CudaVector;
    /// LoRA adapters do not run on CUDA (`supports_lora` is false).
    type LoraMatrix = ();
    type Rope = CudaRope;
    type KvStore = CudaKvStore;
    type Buffer = CudaBuffer;
    type View<'a> = CudaView<'a>;
    type ViewMut<'a> = CudaViewMut<'a>;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn load_weight(
        &self,
        tensor: HostTensor,
        convert: Option<GgmlType>,
    ) -> Result<CudaWeight, LoadTensorError> {
        let (rows, cols) = (tensor.rows(), tensor.cols());
        let dev = |e: crate::CudaError| LoadTensorError::Device(e.0);
        let mem = self.device.alloc(2 * rows * cols).map_err(dev)?;
        if tensor.ty() == GgmlType::Bf16 && convert.is_none_or(|t| t == GgmlType::Bf16) {
            self.device.upload(mem.ptr, tensor.bytes().as_slice());
        } else {
            let values = host_values(&tensor, convert)?;
            let halves: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            self.device.upload(mem.ptr, &halves);
        }
        self.device.synchronize();
        Ok(CudaWeight { mem, rows, cols })
    }

    fn weight_bytes(&self, weight: &CudaWeight) -> usize {
        2 * weight.rows * weight.cols
    }

    fn load_vector(&self, values: &[f32]) -> Result<CudaVector, LoadTensorError> {
        let mem = self.device.alloc(4 * values.len()).map_err(|e| LoadTensorError::Device(e.0))?;
        self.device.upload(mem.ptr, values);
        self.device.synchronize();
        Ok(CudaVector { mem, len: values.len() })
    }

    fn load_lora_matrix(
        &self,
        _values: &[f32],
        _dtype: kiln_backend::LoraDtype,
    ) -> Result<(), LoadTensorError> {
        Err(LoadTensorError::Unsupported("LoRA adapters on CUDA".into()))
    }

    fn load_rope(&self, config: &RopeConfig) -> Result<CudaRope, LoadTensorError> {
        if config.rotary_dim == 0 || !config.rotary_dim.is_multiple_of(2) {
            return Err(LoadTensorError::Unsupported("an odd rotary dimension".into()));
        }
        if config.mscale != 1.0 {
            return Err(LoadTensorError::Unsupported(format!(
                "a RoPE cos/sin multiplier ({}: LongRoPE's attention factor with a partial \
                 rotary factor, as Phi-4-mini's) is not implemented on CUDA yet",
                config.mscale
            )));
        }
        // The same frequencies as the CPU backend's (parameters, not arithmetic).
        let v = self.load_vector(&config.inv_freq())?;
        Ok(CudaRope { inv_freq: v.mem, half: config.rotary_dim / 2, style: config.style })
    }

    fn alloc_kv(&self, spec: KvCacheSpec) -> Result<CudaKvStore, ForwardError> {
        kiln_backend::check_block_size(spec.block_size)
            .map_err(|e| ForwardError::KvLayout(format!("block size {e}")))?;
        if spec.layout.values_from_keys {
            return Err(ForwardError::KvLayout(
                "the CUDA backend does not run latent attention (a cache whose values are its \
                 keys)"
                    .into(),
            ));
        }
        if !matches!(spec.dtype, KvCacheDtype::F16 | KvCacheDtype::F32) {
            return Err(ForwardError::KvLayout(format!(
                "the CUDA backend stores the KV cache as f16 or f32, not {}",
                spec.dtype.name()
            )));
        }
        if spec.layout.head_dim > MAX_HEAD_DIM {
            return Err(ForwardError::KvLayout(format!(
                "the CUDA backend's attention takes head dimensions up to {MAX_HEAD_DIM}, not {}",
                spec.layout.head_dim
            )));
        }
        let bytes = spec.layer_elems() * spec.dtype.bytes();
        let layer = || -> Result<_, ForwardError> {
            let m = self.device.alloc(bytes).map_err(|e| ForwardError::Device(e.0))?;
            self.device.zero(&m);
            Ok(m)
        };
        let n = spec.layout.num_layers;
        let k = (0..n).map(|_| layer()).collect::<Result<Vec<_>, _>>()?;
        let v = (0..n).map(|_| layer()).collect::<Result<Vec<_>, _>>()?;
        self.device.synchronize();
        Ok(CudaKvStore { spec, k, v })
    }

    fn kv_spec(&self, kv: &CudaKvStore) -> KvCacheSpec {
        kv.spec
    }

    /// Per layer, K's block then V's, in the cache's element type.
    fn kv_block_bytes(&self, kv: &CudaKvStore) -> usize {
        2 * kv.spec.layout.num_layers * kv.layer_block_bytes()
    }

    fn read_kv_block(&self, kv: &CudaKvStore, block: usize, out: &mut [u8]) {
        assert_eq!(out.len(), self.kv_block_bytes(kv), "block buffer size");
        assert!(block < kv.spec.num_blocks, "block {block} of {}", kv.spec.num_blocks);
        let n = kv.layer_block_bytes();
        for (chunk, mem) in
            out.chunks_exact_mut(n).zip(kv.k.iter().zip(&kv.v).flat_map(|(k, v)| [k, v]))
        {
            self.device.download(chunk, mem.ptr + (block * n) as u64);
        }
    }

    fn write_kv_block(&self, kv: &mut CudaKvStore, block: usize, data: &[u8]) {
        assert_eq!(data.len(), self.kv_block_bytes(kv), "block buffer size");
        assert!(block < kv.spec.num_blocks, "block {block} of {}", kv.spec.num_blocks);
        let n = kv.layer_block_bytes();
        for (chunk, mem) in
            data.chunks_exact(n).zip(kv.k.iter().zip(&kv.v).flat_map(|(k, v)| [k, v]))
        {
            self.device.upload(mem.ptr + (block * n) as u64, chunk);
        }
        self.device.synchronize();
    }

    fn new_buffer(&self) -> CudaBuffer {
        CudaBuffer { mem: self.device.alloc_or_panic(0), len: 0 }
    }

    fn reserve(&self, buf: &mut CudaBuffer, len: usize) {
        if buf.len >= len {
            return;
        }
        if self.device.capturing() {
            self.device.recorder().poison("an allocation during a capture");
            return;
        }
        let len = len + len / 4;
        buf.mem = self.device.alloc_or_panic(0); // free the old one first
        buf.mem = self.device.alloc_or_panic(4 * len);
        buf.len = len;
    }

    fn view(buf: &CudaBuffer, range: Range<usize>) -> CudaView<'_> {
        buf.view(range)
    }

    fn view_mut(buf: &mut CudaBuffer, range: Range<usize>) -> CudaViewMut<'_> {
        buf.view_mut(range)
    }

    fn embed(
        &self,
        table: &CudaWeight,
        token_ids: &[u32],
        scale: Option<f32>,
        out: CudaViewMut<'_>,
    ) {
        let h = table.cols;
        assert_eq!(out.len, token_ids.len() * h, "embed output");
        let ids = self.scratch().meta(&self.device, Meta::TokenIds, token_ids);
        let args = [
            Arg::Ptr(table.mem.ptr),
            Arg::Ptr(ids),
            Arg::Ptr(out.ptr),
            Arg::I32(h as i32),
            Arg::F32(scale.unwrap_or(1.0)),
        ];
        let grid = row_grid(token_ids.len(), h);
        launch(&self.device, &self.kernels.embed, grid, 256, &args);
    }

    fn linear(&self, x: CudaView<'_>, m: usize, jobs: &mut [LinearJob<'_, Self>]) {
        let Some(k) = jobs.first().map(|j| j.weight.cols) else { return };
        let mut scratch = self.scratch();
        let xb = self.to_bf16(&mut scratch, x, m * k);
        for job in jobs.iter() {
            let n = job.weight.rows;
            assert_eq!(job.weight.cols, k, "linear jobs share their input");
            assert_eq!(job.out.len, m * n, "linear output");
            self.gemm(xb, m, job.weight, job.out.ptr);
            if let Some(bias) = job.bias {
                assert_eq!(bias.len, n, "bias length");
                let args = [Arg::Ptr(job.out.ptr), Arg::Ptr(bias.mem.ptr), Arg::I32(n as i32)];
                launch(&self.device, &self.kernels.add_bias, row_grid(m, n), 256, &args);
            }
        }
    }

    fn rms_norm(&self, x: CudaView<'_>, weight: &CudaVector, eps: f32, out: CudaViewMut<'_>) {
        assert_eq!(x.len, out.len, "rms_norm output");
        self.rms_norm_rows(x.ptr, weight, eps, out.ptr, x.len);
    }

    fn rms_norm_inplace(&self, x: CudaViewMut<'_>, weight: &CudaVector, eps: f32) {
        self.rms_norm_rows(x.ptr, weight, eps, x.ptr, x.len);
    }

    fn residual_norm(
        &self,
        d: usize,
        branch: CudaViewMut<'_>,
        post: Option<&CudaVector>,
        x: CudaViewMut<'_>,
        next: Option<(&CudaVector, CudaViewMut<'_>)>,
        eps: f32,
    ) {
        assert!(d > 0 && x.len.is_multiple_of(d) && branch.len == x.len, "residual rows");
        let (next_w, out) = match &next {
            Some((w, out)) => {
                assert!(w.len == d && out.len == x.len, "residual norm output");
                (w.mem.ptr, out.ptr)
            }
            None => (0, 0),
        };
        let post = post.map_or(0, |w| {
            assert_eq!(w.len, d, "post norm");
            w.mem.ptr
        });
        let args = [
            Arg::Ptr(branch.ptr),
            Arg::Ptr(post),
            Arg::Ptr(x.ptr),
            Arg::Ptr(next_w),
            Arg::Ptr(out),
            Arg::I32(d as i32),
            Arg::F32(eps),
        ];
        let threads = norm_threads(d);
        launch(&self.device, &self.kernels.residual_norm, grid1(x.len / d), threads, &args);
    }

    fn rope_table(&self, rope: &CudaRope, positions: &[u32], table: CudaViewMut<'_>) {
        assert_eq!(table.len, positions.len() * 2 * rope.half, "rope table");
        let pos = self.scratch().meta(&self.device, Meta::Positions, positions);
        let args = [
            Arg::Ptr(pos),
            Arg::Ptr(rope.inv_freq.ptr),
            Arg::Ptr(table.ptr),
            Arg::I32(rope.half as i32),
        ];
        launch(&self.device, &self.kernels.rope_table, grid1(positions.len()), 128, &args);
    }

    fn rope_apply(
        &self,
        rope: &CudaRope,
        x: CudaViewMut<'_>,
        num_heads: usize,
        table: CudaView<'_>,
    ) {
        let num_tokens = table.len / (2 * rope.half);
        if num_tokens == 0 || num_heads == 0 {
            return;
        }
        let head_dim = x.len / num_tokens / num_heads;
        assert!(head_dim >= 2 * rope.half && x.len == num_tokens * num_heads * head_dim, "rope");
        let args = [
            Arg::Ptr(x.ptr),
            Arg::Ptr(table.ptr),
            Arg::I32(num_heads as i32),
            Arg::I32(head_dim as i32),
            Arg::I32(rope.half as i32),
            Arg::I32(i32::from(rope.style == RopeStyle::Interleaved)),
        ];
        let grid = row_grid(num_tokens, num_heads * rope.half);
        launch(&self.device, &self.kernels.rope_apply, grid, 256, &args);
    }

    fn gated_act(&self, act: GateActivation, gate: CudaViewMut<'_>, up: CudaView<'_>) {
        assert_eq!(gate.len, up.len, "gated activation");
        let act = match act {
            GateActivation::Silu => 0,
            GateActivation::GeluTanh => 1,
            // Only gpt-oss's experts and encoders use these, and the CUDA backend refuses both.
            GateActivation::ClampedSwiglu { .. } | GateActivation::Gelu => {
                unreachable!("the CUDA backend runs no mixture-of-experts or encoder layer")
            }
        };
        let args = [Arg::Ptr(gate.ptr), Arg::Ptr(up.ptr), Arg::U64(gate.len as u64), Arg::I32(act)];
        launch(
            &self.device,
            &self.kernels.gated_act,
            (blocks_for(gate.len, 256), 1, 1),
            256,
            &args,
        );
    }

    fn write_kv(
        &self,
        kv: &mut CudaKvStore,
        layer: usize,
        k: CudaView<'_>,
        v: CudaView<'_>,
        slot_mapping: &[u32],
    ) {
        let l = kv.spec.layout;
        let row = l.num_kv_heads * l.head_dim;
        assert!(k.len == slot_mapping.len() * row && v.len == k.len, "write_kv rows");
        let slots_total = (kv.spec.num_blocks * kv.spec.block_size) as u32;
        assert!(slot_mapping.iter().all(|&s| s < slots_total), "slot outside the cache");
        let slots = self.scratch().meta(&self.device, Meta::Slots, slot_mapping);
        let func = match kv.spec.dtype {
            KvCacheDtype::F16 => &self.kernels.write_kv_f16,
            _ => &self.kernels.write_kv_f32,
        };
        let args = [
            Arg::Ptr(k.ptr),
            Arg::Ptr(v.ptr),
            Arg::Ptr(slots),
            Arg::Ptr(kv.k[layer].ptr),
            Arg::Ptr(kv.v[layer].ptr),
            Arg::I32(row as i32),
        ];
        launch(&self.device, func, row_grid(slot_mapping.len(), row), 256, &args);
    }

    /// Paged attention (see `kernels.cu`): steps with prompt rows take the tiled prefill kernel
    /// (head dimensions up to 128), decode-only steps the split-K kernel and the merge of its
    /// splits. No token trees (`supports_token_trees` is false: the engine never builds one
    /// for this backend).
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        kv: &CudaKvStore,
        layer: usize,
        q: CudaView<'_>,
        seqs: &[SeqSpan],
        block_tables: &[u32],
        (tree, sinks): (Option<kiln_backend::TreeMask<'_>>, Option<&CudaVector>),
        shape: &AttentionShape,
        out: CudaViewMut<'_>,
    ) {
        assert!(tree.is_none(), "token trees on the CUDA backend");
        assert!(sinks.is_none(), "attention sinks on the CUDA backend");
        assert!(shape.causal, "bidirectional attention on the CUDA backend");
        let (hd, nh) = (shape.head_dim, shape.num_heads);
        let num_rows: usize = seqs.iter().map(|s| s.query_len).sum();
        assert!(q.len == num_rows * nh * hd && out.len == q.len, "attention rows");
        assert!(hd <= MAX_HEAD_DIM && shape.block_size == kv.spec.block_size, "attention shape");
        if num_rows == 0 {
            return;
        }
        let mut flat = Vec::with_capacity(4 * seqs.len());
        let mut row_seq = vec![0u32; num_rows];
        for (i, s) in seqs.iter().enumerate() {
            assert!(s.query_start + s.query_len <= num_rows && s.query_len <= s.context_len, "seq");
            let blocks = s.context_len.div_ceil(shape.block_size);
            assert!(s.block_table_start + blocks <= block_tables.len(), "block table");
            flat.extend(
                [s.query_start, s.query_len, s.context_len, s.block_table_start].map(|v| v as u32),
            );
            row_seq[s.query_start..s.query_start + s.query_len].fill(i as u32);
        }
        let num_blocks = kv.spec.num_blocks as u32;
        assert!(block_tables.iter().all(|&b| b < num_blocks), "block outside the cache");
        let mut scratch = self.scratch();
        let seqs_dev = scratch.meta(&self.device, Meta::Seqs, &flat);
        let tables_dev = scratch.meta(&self.device, Meta::BlockTables, block_tables);
        // The leading and trailing arguments both kernels share.
        let inputs = [
            Arg::Ptr(q.ptr),
            Arg::Ptr(kv.k[layer].ptr),
            Arg::Ptr(kv.v[layer].ptr),
            Arg::I32(i32::from(kv.spec.dtype == KvCacheDtype::F16)),
            Arg::Ptr(seqs_dev),
        ];
        let common = [
            Arg::I32(nh as i32),
            Arg::I32(shape.num_kv_heads as i32),
            Arg::I32(hd as i32),
            Arg::I32(shape.block_size as i32),
            Arg::F32(shape.scale),
            Arg::I32(shape.sliding_window.map_or(0, |w| w.min(i32::MAX as usize) as i32)),
            Arg::F32(shape.softcap.unwrap_or(0.0)),
        ];
        // A step with prompt rows: tiles of query rows share each key they read.
        if hd <= PREFILL_MAX_HEAD_DIM && seqs.iter().any(|s| s.query_len > 1) {
            let mut tiles = Vec::new();
            for (i, s) in seqs.iter().enumerate() {
                for first in (s.query_start..s.query_start + s.query_len).step_by(PREFILL_ROWS) {
                    tiles.extend([i as u32, first as u32]);
                }
            }
            let tiles_dev = scratch.meta(&self.device, Meta::Tiles, &tiles);
            let mut args = inputs.to_vec();
            args.extend([Arg::Ptr(tiles_dev), Arg::Ptr(tables_dev), Arg::Ptr(out.ptr)]);
            args.extend(common);
            let grid = ((tiles.len() / 2) as u32, nh as u32, 1);
            launch(&self.device, &self.kernels.attention_prefill, grid, PREFILL_THREADS, &args);
            return;
        }
        // The most splits of any row (its keys: positions context_len - query_len ..=
        // context_len - 1), as a power of two so that a graph's trace changes only when a
        // row's splits double.
        let row_splits = |keys: usize| {
            let keys = shape.sliding_window.map_or(keys, |w| keys.min(w));
            keys.div_ceil(decode_split_keys(keys))
        };
        let splits = seqs
            .iter()
            .flat_map(|s| s.context_len - s.query_len + 1..=s.context_len)
            .map(row_splits)
            .max()
            .unwrap_or(1)
            .next_power_of_two();
        let row_seq_dev = scratch.meta(&self.device, Meta::RowSeq, &row_seq);
        let parts = num_rows * nh * splits;
        let part_out = grown(&self.device, &mut scratch.parts, 4 * parts * hd);
        let part_ml = grown(&self.device, &mut scratch.parts_ml, 8 * parts);
        let mut args = inputs.to_vec();
        args.extend([
            Arg::Ptr(row_seq_dev),
            Arg::Ptr(tables_dev),
            Arg::Ptr(part_out),
            Arg::Ptr(part_ml),
        ]);
        args.extend(common);
        args.push(Arg::I32(splits as i32));
        let grid = (num_rows as u32, nh as u32, splits as u32);
        launch(&self.device, &self.kernels.paged_attention, grid, DECODE_THREADS, &args);
        let args = [
            Arg::Ptr(part_out),
            Arg::Ptr(part_ml),
            Arg::Ptr(out.ptr),
            Arg::I32(nh as i32),
            Arg::I32(hd as i32),
            Arg::I32(splits as i32),
        ];
        let threads = hd.next_multiple_of(32) as u32;
        launch(
            &self.device,
            &self.kernels.attention_combine,
            (num_rows as u32, nh as u32, 1),
            threads,
            &args,
        );
    }

    fn compact_rows(&self, buf: CudaViewMut<'_>, width: usize, rows: &[usize]) {
        if rows.is_empty() {
            return;
        }
        assert!(rows.iter().all(|&r| (r + 1) * width <= buf.len), "compact rows");
        let mut scratch = self.scratch();
        let idx = scratch.meta(&self.device, Meta::Rows, &to_u32(rows));
        let bytes = 4 * rows.len() * width;
        let tmp = grown(&self.device, &mut scratch.rows, bytes);
        self.gather(buf.ptr, idx, tmp, rows.len(), width);
        self.device.copy(buf.ptr, tmp, bytes);
    }

    fn gather_rows(&self, src: CudaView<'_>, width: usize, rows: &[usize], dst: CudaViewMut<'_>) {
        assert!(rows.iter().all(|&r| (r + 1) * width <= src.len), "gather rows");
        assert!(rows.len() * width <= dst.len, "gather output");
        let idx = self.scratch().meta(&self.device, Meta::Rows, &to_u32(rows));
        self.gather(src.ptr, idx, dst.ptr, rows.len(), width);
    }

    fn logits(
        &self,
        x: CudaView<'_>,
        m: usize,
        head: &CudaWeight,
        softcap: Option<f32>,
        out: &mut Logits,
    ) {
        let n = head.rows;
        out.reset(m, n);
        if m == 0 {
            return;
        }
        let mut scratch = self.scratch();
        let xb = self.to_bf16(&mut scratch, x, m * head.cols);
        let dev = grown(&self.device, &mut scratch.logits, 4 * m * n);
        self.gemm(xb, m, head, dev);
        if let Some(cap) = softcap {
            let args = [Arg::Ptr(dev), Arg::U64((m * n) as u64), Arg::F32(cap)];
            launch(&self.device, &self.kernels.softcap, (blocks_for(m * n, 256), 1, 1), 256, &args);
        }
        if !self.device.recorder().defer_download(dev, m * n) {
            self.device.download(out.as_mut_slice(), dev);
        }
    }

    /// Decode and verification steps replay CUDA graphs ([`crate::graphs`]).
    fn run_step(
        &self,
        batch: &kiln_backend::ForwardBatch,
        logits: &mut Logits,
        forward: &mut dyn FnMut(&mut Logits) -> Result<(), ForwardError>,
    ) -> Result<(), ForwardError> {
        self.run_step_graphed(batch, logits, forward)
    }
}

impl Cuda {
    fn rms_norm_rows(&self, x: u64, weight: &CudaVector, eps: f32, out: u64, len: usize) {
        let d = weight.len;
        assert!(d > 0 && len.is_multiple_of(d), "rms_norm rows of {d} over {len}");
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(weight.mem.ptr),
            Arg::Ptr(out),
            Arg::I32(d as i32),
            Arg::F32(eps),
        ];
        launch(&self.device, &self.kernels.rms_norm, grid1(len / d), norm_threads(d), &args);
    }

    /// `dst[i] = src[idx[i]]` for `n` rows of `width` (device addresses).
    fn gather(&self, src: u64, idx: u64, dst: u64, n: usize, width: usize) {
        let args = [Arg::Ptr(src), Arg::Ptr(idx), Arg::Ptr(dst), Arg::I32(width as i32)];
        launch(&self.device, &self.kernels.gather_rows, row_grid(n, width), 256, &args);
    }
}
