//! The bidirectional encoder of BERT, RoBERTa and XLM-RoBERTa (embedding models such as
//! all-MiniLM, bge, e5, bge-m3, and their cross-encoder rerankers), from safetensors or GGUF
//! (`bert`) weights. It serves pooling only: a step hands back final hidden states.
//!
//! The input is `layernorm(word[id] + type[segment] + position[pos + offset])`; each layer is
//! post-norm with biases everywhere: `h = layernorm(h + o(attn(q(h), k(h), v(h))))`, then
//! `h = layernorm(h + down(gelu(up(h))))`; the output is the last layer's `h` (no final norm).
//! Attention is not causal: every token sees its whole sequence. So a sequence must come whole
//! in one step (its first position 0, all of its tokens): the K/V of later tokens must exist
//! before any row attends. The step writes them to its blocks of the paged cache and reads them
//! back through the backend's paged attention (non-causal), and the scheduler frees the blocks
//! with the request: nothing is cached across requests (no prefix cache; an engine serving an
//! encoder schedules whole prompts, `kiln-engine`).
//!
//! Token types: the tokens after a sequence's first `[SEP]` are type 1 when the model has two
//! or more types (a BERT cross-encoder's pair `[CLS] a [SEP] b [SEP]`, as the tokenizer's pair
//! template types them); every other token is type 0, as for one text.
//!
//! Everything but attention works on each token's row alone, so a row's output depends only on
//! its own sequence: batched == alone.

use std::sync::Arc;

use kiln_backend::{
    AttentionShape, Backend, ForwardBatch, ForwardError, KvLayout, LinearJob, Logits, Workspace,
};

use crate::config::EncoderConfig;
use crate::model::Model;
use crate::weights::Weights;
use crate::{LoadError, ModelConfig};

mod names;

pub(crate) use names::EncoderNames;
use names::Role;

/// A linear layer with its bias.
struct Linear<B: Backend> {
    weight: B::Weight,
    bias: B::Vector,
}

/// A LayerNorm's scale and shift.
struct Norm<B: Backend> {
    weight: B::Vector,
    bias: B::Vector,
}

struct Layer<B: Backend> {
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    attn_norm: Norm<B>,
    up: Linear<B>,
    down: Linear<B>,
    out_norm: Norm<B>,
}

pub struct EncoderModel<B: Backend> {
    backend: Arc<B>,
    config: ModelConfig,
    encoder: EncoderConfig,
    /// `[vocab, h]`, `[positions + offset, h]`, `[types, h]` (none without types).
    word: B::Weight,
    position: B::Weight,
    token_types: Option<B::Weight>,
    embed_norm: Norm<B>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> EncoderModel<B> {
    pub(crate) fn load(
        config: ModelConfig,
        w: &Weights<'_, B>,
        names: &EncoderNames,
        backend: Arc<B>,
    ) -> Result<Self, LoadError> {
        let refuse = |message: String| LoadError::Backend { name: "encoder".into(), message };
        let encoder =
            config.encoder.ok_or_else(|| refuse("the config is not an encoder's".into()))?;
        if !backend.supports_encoders() || !backend.supports_pooling() {
            return Err(refuse(format!("the {} backend does not run encoders", backend.name())));
        }
        let c = &config;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        if c.num_kv_heads != c.num_heads || c.num_heads * c.head_dim != h {
            return Err(refuse(format!(
                "{} heads of {} must make the hidden size {h}",
                c.num_heads, c.head_dim
            )));
        }
        let linear = |name: String, rows: usize, cols: usize| -> Result<Linear<B>, LoadError> {
            Ok(Linear {
                weight: w.named_matrix(&format!("{name}.weight"), rows, cols)?,
                bias: w.named_vector(&format!("{name}.bias"), rows)?,
            })
        };
        let norm = |name: String| -> Result<Norm<B>, LoadError> {
            Ok(Norm {
                weight: w.named_vector(&format!("{name}.weight"), h)?,
                bias: w.named_vector(&format!("{name}.bias"), h)?,
            })
        };
        let layers = (0..c.num_layers)
            .map(|l| {
                Ok(Layer {
                    q: linear(names.layer(l, Role::Q), h, h)?,
                    k: linear(names.layer(l, Role::K), h, h)?,
                    v: linear(names.layer(l, Role::V), h, h)?,
                    o: linear(names.layer(l, Role::O), h, h)?,
                    attn_norm: norm(names.layer(l, Role::AttnNorm))?,
                    up: linear(names.layer(l, Role::Up), i, h)?,
                    down: linear(names.layer(l, Role::Down), h, i)?,
                    out_norm: norm(names.layer(l, Role::OutNorm))?,
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        let positions = c.max_position_embeddings + encoder.position_offset;
        let types = encoder.type_vocab_size;
        let token_types = match types {
            0 => None,
            n => Some(w.named_matrix(&names.token_types(), n, h)?),
        };
        Ok(Self {
            word: w.named_matrix(&names.word(), c.vocab_size, h)?,
            position: w.named_matrix(&names.position(), positions, h)?,
            token_types,
            embed_norm: norm(names.embed_norm())?,
            layers,
            encoder,
            config,
            backend,
        })
    }

    fn check_batch(&self, batch: &ForwardBatch, kv: &B::KvStore) -> Result<(), ForwardError> {
        crate::model::check_cache_and_batch(self, batch, kv)?;
        if !batch.hidden_output() {
            return Err(ForwardError::Batch(
                "an encoder has no LM head: its steps give hidden states".into(),
            ));
        }
        if batch.tree_mask().is_some() {
            return Err(ForwardError::Batch("an encoder runs no token trees".into()));
        }
        if let Some((i, s)) =
            batch.seqs().iter().enumerate().find(|(_, s)| s.context_len != s.query_len)
        {
            return Err(ForwardError::Batch(format!(
                "an encoder runs each sequence whole in one step: sequence {i} brings {} of its \
                 {} tokens",
                s.query_len, s.context_len
            )));
        }
        let limit = self.config.max_position_embeddings;
        if let Some(p) = batch.positions().iter().find(|&&p| p as usize >= limit) {
            return Err(ForwardError::Batch(format!(
                "position {p} is past the encoder's {limit} positions"
            )));
        }
        self.attention_shape(batch.block_size()).validate().map_err(ForwardError::KvLayout)
    }

    fn attention_shape(&self, block_size: usize) -> AttentionShape {
        let c = &self.config;
        AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size,
            scale: c.attention_scale,
            sliding_window: None,
            causal: false,
            softcap: None,
        }
    }

    /// Fills `ids` with each token's row of the position table, then `types` with its token
    /// type (module docs).
    fn embedding_rows(&self, batch: &ForwardBatch, ids: &mut Vec<u32>, types: &mut Vec<u32>) {
        let offset = self.encoder.position_offset as u32;
        ids.clear();
        ids.extend(batch.positions().iter().map(|p| p + offset));
        types.clear();
        let tokens = batch.token_ids();
        for s in batch.seqs() {
            let seq = &tokens[s.query_start..s.query_start + s.query_len];
            let mut segment = 0;
            for &token in seq {
                types.push(segment);
                if self.encoder.type_vocab_size > 1 && self.encoder.segment_separator == Some(token)
                {
                    segment = 1;
                }
            }
        }
    }
}

impl<B: Backend> Model<B> for EncoderModel<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn backend(&self) -> &B {
        &self.backend
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            num_layers: self.config.num_layers,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            values_from_keys: false,
        }
    }

    fn weight_bytes(&self) -> usize {
        let be = &*self.backend;
        self.layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.up, &l.down])
            .map(|m| be.weight_bytes(&m.weight))
            .sum()
    }

    fn forward(
        &self,
        batch: &ForwardBatch,
        kv: &mut B::KvStore,
        workspace: &mut Workspace<B>,
        out: &mut Logits,
    ) -> Result<(), ForwardError> {
        self.check_batch(batch, kv)?;
        let c = &self.config;
        let be = &*self.backend;
        let (t, h, inter) = (batch.num_tokens(), c.hidden_size, c.intermediate_size);
        let eps = self.encoder.layer_norm_eps;
        let (mut ids, mut types) =
            (std::mem::take(&mut workspace.row_ids), std::mem::take(&mut workspace.row_types));
        self.embedding_rows(batch, &mut ids, &mut types);
        let [hidden, q, k, v, attn, proj, up, rows] =
            workspace.take(be, [t * h, t * h, t * h, t * h, t * h, t * h, t * inter, t * h]);
        let all = 0..t * h;
        be.embed(&self.word, batch.token_ids(), None, B::view_mut(hidden, all.clone()));
        if let Some(table) = &self.token_types {
            be.embed(table, &types, None, B::view_mut(proj, all.clone()));
            let (branch, x) = (B::view_mut(proj, all.clone()), B::view_mut(hidden, all.clone()));
            be.residual_norm(h, branch, None, x, None, eps);
        }
        be.embed(&self.position, &ids, None, B::view_mut(proj, all.clone()));
        let norm = (&self.embed_norm.weight, &self.embed_norm.bias);
        let (x, pos) = (B::view_mut(hidden, all.clone()), B::view(proj, all.clone()));
        be.layer_norm(h, x, Some(pos), norm, eps);
        let shape = self.attention_shape(batch.block_size());
        for (l, layer) in self.layers.iter().enumerate() {
            let x = B::view(hidden, all.clone());
            let (qo, ko, vo) = (
                B::view_mut(q, all.clone()),
                B::view_mut(k, all.clone()),
                B::view_mut(v, all.clone()),
            );
            be.linear(x, t, &mut [job(&layer.q, qo), job(&layer.k, ko), job(&layer.v, vo)]);
            be.write_kv(
                kv,
                l,
                B::view(k, all.clone()),
                B::view(v, all.clone()),
                batch.slot_mapping(),
            );
            let (qv, ao) = (B::view(q, all.clone()), B::view_mut(attn, all.clone()));
            be.paged_attention(
                kv,
                l,
                qv,
                batch.seqs(),
                batch.block_tables(),
                (None, None),
                &shape,
                ao,
            );
            let a = B::view(attn, all.clone());
            be.linear(a, t, &mut [job(&layer.o, B::view_mut(proj, all.clone()))]);
            let norm = (&layer.attn_norm.weight, &layer.attn_norm.bias);
            let (x, branch) = (B::view_mut(hidden, all.clone()), B::view(proj, all.clone()));
            be.layer_norm(h, x, Some(branch), norm, eps);
            let x = B::view(hidden, all.clone());
            be.linear(x, t, &mut [job(&layer.up, B::view_mut(up, 0..t * inter))]);
            be.activation(c.hidden_act, B::view_mut(up, 0..t * inter));
            let u = B::view(up, 0..t * inter);
            be.linear(u, t, &mut [job(&layer.down, B::view_mut(proj, all.clone()))]);
            let norm = (&layer.out_norm.weight, &layer.out_norm.bias);
            let (x, branch) = (B::view_mut(hidden, all.clone()), B::view(proj, all.clone()));
            be.layer_norm(h, x, Some(branch), norm, eps);
        }
        let wanted = batch.logits_rows();
        let n = wanted.len();
        if n == t {
            be.rows_to_host(B::view(hidden, all), t, h, out);
        } else {
            be.gather_rows(B::view(hidden, all), h, wanted, B::view_mut(rows, 0..n * h));
            be.rows_to_host(B::view(rows, 0..n * h), n, h, out);
        }
        workspace.row_ids = ids;
        workspace.row_types = types;
        Ok(())
    }
}

/// One matrix of a [`Backend::linear`] call with its bias.
fn job<'a, B: Backend>(m: &'a Linear<B>, out: B::ViewMut<'a>) -> LinearJob<'a, B> {
    LinearJob { weight: &m.weight, bias: Some(&m.bias), out }
}
