"""Kimi Delta Attention (KDA) in plain XLA: the readable oracle the kernels are tested against.

KDA is the gated delta rule with a per-channel forget gate (Kimi Linear, arXiv:2510.26692; transformers'
``recurrent_kimi_delta_attention`` / ``chunk_kimi_delta_attention``). Per batch row and head a state
S [K, V] (fp32) runs over the tokens; for token t, with the query scaled by K^-0.5:

    S   <- S * exp(g_t)[:, None]                 # g_t [K] <= 0: log of the channel-wise forget gate
    d_t  = beta_t * (v_t - S^T k_t)              # the delta rule's correction [V]
    S   <- S + k_t d_t^T
    o_t  = S^T q_t

Packed documents (``segment_ids`` [B, T], nonzero ids): the state restarts from zero at every token whose id
differs from the previous token's, so different documents never interact. The initial state is the state
before token 0: only the row's first segment sees it. Padding (id 0) passes the state through unchanged
(`pass_state_through_padding`), so the final state, the state after the row's last token, is that of the
row's last document also when the row is right-padded. Outputs at padding tokens are meaningless.

Shapes: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; states [B, H, K, V].
"""
import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _fp32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def _initial_state(initial_state_BHKV, B, H, K, V):
    if initial_state_BHKV is None:
        return jnp.zeros((B, H, K, V), jnp.float32)
    return initial_state_BHKV.astype(jnp.float32)


def pass_state_through_padding(g_BTHK, beta_BTH, segment_ids_BT):
    """(g, beta, segment ids) with padding tokens (id 0) made transparent: gate 0 and beta 0 (the state is
    neither decayed nor updated) and the id of the last document before them (no restart)."""
    if segment_ids_BT is None:
        B, T = beta_BTH.shape[:2]
        return g_BTHK, beta_BTH, jnp.ones((B, T), jnp.int32)
    seg = segment_ids_BT.astype(jnp.int32)
    pad_BT = seg == 0
    T = seg.shape[1]
    last_real = jax.lax.cummax(jnp.where(pad_BT, -1, jnp.arange(T)), axis=1)
    seg = jnp.where(last_real < 0, seg, jnp.take_along_axis(seg, jnp.maximum(last_real, 0), axis=1))
    def per_token(x):   # the token's flag over x's trailing axes (g [B, T, H, K] or its flat [B, T, H * K])
        return pad_BT.reshape(pad_BT.shape + (1,) * (x.ndim - 2))

    return jnp.where(per_token(g_BTHK), 0.0, g_BTHK), jnp.where(per_token(beta_BTH), 0.0, beta_BTH), seg


def recurrent_step(S_BHKV, q_BHK, k_BHK, v_BHV, g_BHK, beta_BH):
    """One token of the recurrence (q already scaled): (o [B, H, V], the new state)."""
    S = S_BHKV * jnp.exp(g_BHK)[..., None]
    delta_BHV = beta_BH[..., None] * (v_BHV - jnp.einsum("bhk,bhkv->bhv", k_BHK, S, precision=HIGHEST))
    S = S + k_BHK[..., None] * delta_BHV[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q_BHK, S, precision=HIGHEST), S


def recurrent_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV=None, segment_ids_BT=None):
    """The naive per-token recurrence: (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32)."""
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    q, k, v, g, beta = _fp32(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)
    q = q * K**-0.5
    g, beta, seg = pass_state_through_padding(g, beta, segment_ids_BT)
    restart_BT = seg != jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)

    def token(S, xs):
        restart_B, *x = xs
        S = jnp.where(restart_B[:, None, None, None], 0.0, S)
        o, S = recurrent_step(S, *x)
        return S, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (restart_BT, q, k, v, g, beta))
    S, o_TBHV = jax.lax.scan(token, _initial_state(initial_state_BHKV, B, H, K, V), xs)
    return jnp.moveaxis(o_TBHV, 0, 1).astype(q_BTHK.dtype), S


def chunk_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV=None, segment_ids_BT=None,
              chunk_size=64):
    """The chunked (WY) form, as transformers' ``chunk_kimi_delta_attention``, with packed documents.

    Within a chunk of C tokens, with G = cumsum(g) along the chunk and decay(i, j) = exp(G_i - G_j) [K]
    (j <= i, same document):

        A_kk[i, j] = beta_i sum_k k_i k_j decay(i, j)   (j < i)    T = (I + A_kk)^-1   (unit lower triangular)
        A_qk[i, j] = sum_k q_i k_j decay(i, j)          (j <= i)
        U = T (beta v)      W = T (beta k exp(G))       (W only on tokens that see the carried state)
        V_new = U - W S                                  # the deltas with the carried state's part removed
        O     = (q exp(G)) S + A_qk V_new
        S'    = exp(G_last) * S + (k exp(G_last - G))^T V_new   (only the chunk's last document's tokens)

    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32).
    """
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    q, k, v, g, beta = _fp32(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)
    g, beta, seg_BT = pass_state_through_padding(g, beta, segment_ids_BT)
    # padded tokens: k = v = g = beta = 0 (the state passes them unchanged), in the last token's document
    q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    seg_BT = jnp.pad(seg_BT, [(0, 0), (0, pad)], mode="edge")

    def chunks(x):   # [B, N*C, H, ...] -> [B, H, N, C, ...]
        return jnp.moveaxis(x.reshape(B, N, C, H, *x.shape[3:]), 3, 1)

    q, k, v, g, beta = (chunks(x) for x in (q * K**-0.5, k, v, g, beta))
    seg = seg_BT.reshape(B, 1, N, C)
    prev = jnp.concatenate([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], axis=2)   # the carried state's document
    sees_state = (seg == prev)[..., None]
    in_last = (seg == seg[..., -1:])[..., None]
    keep = (seg[..., -1] == prev[..., 0])[..., None, None]                      # [B, 1, N, 1, 1]

    G = jnp.cumsum(g, axis=-2)
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    same = seg[..., :, None] == seg[..., None, :]
    lower = (j <= i) & same
    decay_CCK = jnp.exp(jnp.where(lower[..., None], G[..., :, None, :] - G[..., None, :, :], -jnp.inf))
    a_qk = jnp.einsum("...ik,...jk,...ijk->...ij", q, k, decay_CCK, precision=HIGHEST)
    a_kk = jnp.where(j < i, beta[..., None] * jnp.einsum("...ik,...jk,...ijk->...ij", k, k, decay_CCK,
                                                          precision=HIGHEST), 0.0)
    eye = jnp.eye(C, dtype=jnp.float32)
    t = jax.scipy.linalg.solve_triangular(eye + a_kk, jnp.broadcast_to(eye, a_kk.shape), lower=True,
                                          unit_diagonal=True)
    u = jnp.einsum("...ij,...jv->...iv", t, beta[..., None] * v, precision=HIGHEST)
    w = jnp.einsum("...ij,...jk->...ik", t, jnp.where(sees_state, beta[..., None] * k * jnp.exp(G), 0.0),
                   precision=HIGHEST)
    q_decayed = jnp.where(sees_state, q * jnp.exp(G), 0.0)
    k_to_end = jnp.where(in_last, k * jnp.exp(G[..., -1:, :] - G), 0.0)
    state_decay = jnp.where(keep, jnp.exp(G[..., -1, :])[..., None], 0.0)       # [B, H, N, K, 1]

    def chunk(S_BHKV, xs):
        u, w, q_decayed, a_qk, k_to_end, state_decay = xs
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, S_BHKV, precision=HIGHEST)
        o = (jnp.einsum("bhck,bhkv->bhcv", q_decayed, S_BHKV, precision=HIGHEST)
             + jnp.einsum("bhij,bhjv->bhiv", a_qk, v_new, precision=HIGHEST))
        S = state_decay * S_BHKV + jnp.einsum("bhck,bhcv->bhkv", k_to_end, v_new, precision=HIGHEST)
        return S, o

    xs = tuple(jnp.moveaxis(jnp.broadcast_to(x, x.shape[:1] + (H,) + x.shape[2:]), 2, 0)
               for x in (u, w, q_decayed, a_qk, k_to_end, state_decay))
    S, o_NBHCV = jax.lax.scan(chunk, _initial_state(initial_state_BHKV, B, H, K, V), xs)
    o_BTHV = jnp.moveaxis(o_NBHCV, 0, 1).transpose(0, 1, 3, 2, 4).reshape(B, N * C, H, V)
    return o_BTHV[:, :T].astype(q_BTHK.dtype), S
