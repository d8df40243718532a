//! The Mixture-of-Experts router: which experts each token visits, with what weight, and
//! which assignments an expert has no room for (Switch Transformer, Fedus et al. 2021;
//! GShard, Lepikhin et al. 2020). Host math on a micro-batch's N x E router logits (a few
//! KiB): the experts' matmuls run on the backend, the decisions here.
//!
//! ```text
//! forward:   p[t]      = softmax(logits[t])                       (N x E)
//!            choice[t] = the top_k experts of p[t] (ties: the lower index)
//!            slots     = for each choice rank r, for each token t in order: expert
//!                        e = choice[t][r] takes t if it has fewer than C tokens, else the
//!                        assignment is dropped (the token goes on through the residual)
//!            gate      = p[t][e] of each filled slot; the layer's output for t is
//!                        sum over its slots of gate x expert_e(x_t)
//!            balance   = E x sum_e f_e x P_e,  f_e = share of the N*top_k choices that
//!                        named e (before capacity), P_e = mean_t p[t][e]; 1 when even
//! backward:  dp[t][e]  = dgate of (t, e)'s slot (if it was kept) + w x E x f_e / N
//!                        (f_e is a count: no gradient), w = d(objective)/d(balance)
//!            dlogits[t] = p[t] * (dp[t] - sum_j p[t][j] dp[t][j])   (softmax backward)
//! ```

/// A slot no token filled.
pub const EMPTY: u32 = u32::MAX;

/// One micro-batch's routing decisions through one block (kept for its backward; the
/// probabilities and gates are kept where the activations are).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    pub experts: usize,
    /// Rows each expert takes (C).
    pub capacity: usize,
    /// For each slot `e * C + j`, the token in it (EMPTY: none).
    pub slot_token: Vec<u32>,
    /// For each expert, the choices that named it (before capacity).
    pub chosen: Vec<u32>,
    /// Assignments dropped for want of capacity.
    pub dropped: usize,
    /// Switch's load-balancing loss, E x sum_e f_e P_e.
    pub balance: f64,
}

/// What [`route`] decides and computes: the decisions, the router probabilities (N x E)
/// and each slot's gate.
pub struct Routed {
    pub routing: Routing,
    pub probs: Vec<f64>,
    pub gates: Vec<f64>,
}

/// Routes the tokens whose router logits are `logits` (N x `experts`), each to its
/// `top_k` most probable experts, `capacity` tokens at most per expert.
pub fn route(logits: &[f64], experts: usize, top_k: usize, capacity: usize) -> Routed {
    let n = logits.len() / experts;
    let mut probs = logits.to_vec();
    for row in probs.chunks_mut(experts) {
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut sum = 0.0f64;
        for p in row.iter_mut() {
            *p = (*p - max).exp();
            sum += *p;
        }
        row.iter_mut().for_each(|p| *p /= sum);
    }
    let choices: Vec<Vec<usize>> = probs.chunks(experts).map(|row| top(row, top_k)).collect();
    let slots = experts * capacity;
    let (mut slot_token, mut gates) = (vec![EMPTY; slots], vec![0.0f64; slots]);
    let (mut filled, mut chosen, mut dropped) = (vec![0usize; experts], vec![0u32; experts], 0);
    for r in 0..top_k {
        for (t, choice) in choices.iter().enumerate() {
            let e = choice[r];
            chosen[e] += 1;
            if filled[e] == capacity {
                dropped += 1;
                continue;
            }
            let slot = e * capacity + filled[e];
            filled[e] += 1;
            slot_token[slot] = t as u32;
            gates[slot] = probs[t * experts + e];
        }
    }
    let assignments = (n * top_k).max(1) as f64;
    let balance = (0..experts)
        .map(|e| {
            let mean_prob = (0..n).map(|t| probs[t * experts + e]).sum::<f64>() / n.max(1) as f64;
            chosen[e] as f64 / assignments * mean_prob
        })
        .sum::<f64>()
        * experts as f64;
    Routed { routing: Routing { experts, capacity, slot_token, chosen, dropped, balance }, probs, gates }
}

/// The `k` largest entries of `row` (ties to the lower index), most probable first.
fn top(row: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// The router logits' gradient (N x E) from the probabilities `probs` forward computed,
/// each slot's gate gradient `dgates` and the weight `balance_weight` of the balance loss
/// in the objective.
pub fn route_backward(r: &Routing, probs: &[f64], dgates: &[f64], balance_weight: f64) -> Vec<f64> {
    let e_count = r.experts;
    let n = probs.len() / e_count.max(1);
    // N x top_k: every choice named one expert
    let assignments = r.chosen.iter().sum::<u32>().max(1) as f64;
    let mut dprobs: Vec<f64> = (0..n * e_count)
        .map(|i| balance_weight * e_count as f64 * r.chosen[i % e_count] as f64 / assignments / n as f64)
        .collect();
    for (slot, &t) in r.slot_token.iter().enumerate() {
        if t != EMPTY {
            dprobs[t as usize * e_count + slot / r.capacity] += dgates[slot];
        }
    }
    let mut dlogits = vec![0.0f64; n * e_count];
    for t in 0..n {
        let (p, dp) = (&probs[t * e_count..(t + 1) * e_count], &dprobs[t * e_count..(t + 1) * e_count]);
        let inner: f64 = p.iter().zip(dp).map(|(&p, &d)| p * d).sum();
        for e in 0..e_count {
            dlogits[t * e_count + e] = p[e] * (dp[e] - inner);
        }
    }
    dlogits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_fill_their_experts_in_order_and_the_rest_are_dropped() {
        // 4 tokens, 2 experts, top-1, capacity 1: tokens 0, 1, 3 prefer expert 0.
        let logits = [2.0, 0.0, 1.0, 0.0, 0.0, 3.0, 0.5, 0.0];
        let Routed { routing: r, probs, gates } = route(&logits, 2, 1, 1);
        assert_eq!(r.slot_token, vec![0, 2]);
        assert_eq!(r.dropped, 2);
        assert_eq!(r.chosen, vec![3, 1]);
        assert!((gates[0] - probs[0]).abs() < 1e-7 && (gates[1] - probs[5]).abs() < 1e-7);
        // f = (3/4, 1/4); the balance is 2 x sum f_e P_e
        let mean = |e: usize| (0..4).map(|t| probs[t * 2 + e]).sum::<f64>() / 4.0;
        assert!((r.balance - 2.0 * (0.75 * mean(0) + 0.25 * mean(1))).abs() < 1e-9);
    }

    #[test]
    fn second_choices_come_after_every_first_choice() {
        // top-2 over 3 experts, capacity 2: expert 1 is every token's second choice but
        // token 2's first, so token 2's first choice keeps its room.
        let logits = [3.0, 2.0, 0.0, 3.0, 2.0, 0.0, 0.0, 3.0, 2.0];
        let r = route(&logits, 3, 2, 2).routing;
        assert_eq!(&r.slot_token[2..4], &[2, 0]);
        assert_eq!(r.dropped, 1, "token 1's second choice finds expert 1 full");
        assert_eq!(r.chosen.iter().sum::<u32>(), 6);
    }

    #[test]
    fn balance_is_one_when_the_tokens_spread_evenly() {
        let logits = [0.0; 8];
        let r = route(&logits, 2, 1, 4).routing;
        // equal probabilities: ties go to expert 0, so f = (1, 0), P = (1/2, 1/2)
        assert!((r.balance - 1.0).abs() < 1e-12);
        let logits = [1.0, 0.0, 0.0, 1.0];
        let r = route(&logits, 2, 1, 2).routing;
        assert!((r.balance - 1.0).abs() < 1e-6, "{}", r.balance);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let logits: Vec<f64> = (0..15).map(|i| ((i * 7 % 11) as f64 - 5.0) * 0.3).collect();
        let (experts, k, cap) = (3, 2, 3);
        let dgates: Vec<f64> = (0..experts * cap).map(|i| (i as f64 * 0.37).sin()).collect();
        let w = 0.7;
        // objective = sum_slots dgate x gate + w x balance, at fixed routing decisions
        let objective = |l: &[f64]| {
            let r = route(l, experts, k, cap);
            r.gates.iter().zip(&dgates).map(|(g, d)| g * d).sum::<f64>() + w * r.routing.balance
        };
        let Routed { routing: r, probs, .. } = route(&logits, experts, k, cap);
        let analytic = route_backward(&r, &probs, &dgates, w);
        for i in 0..logits.len() {
            let eps = 1e-6;
            let (mut up, mut down) = (logits.clone(), logits.clone());
            up[i] += eps;
            down[i] -= eps;
            assert_eq!(route(&up, experts, k, cap).routing.slot_token, r.slot_token, "a step that changes no decision");
            let numeric = (objective(&up) - objective(&down)) / (2.0 * eps);
            assert!((numeric - analytic[i]).abs() < 1e-8, "dlogits[{i}]: {} vs {numeric}", analytic[i]);
        }
    }
}
