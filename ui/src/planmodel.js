// The Plan screen's logic, pure: which decisions go where, and predicted vs measured.

export const GROUPS = [
  { key: 'set', title: 'Decided' },
  { key: 'kept', title: 'Kept as they are' },
  { key: 'notes', title: 'What the plan read' },
];

/** The decisions of each group, in the plan's order: [{key, title, rows}], empty groups left out. */
export function groupDecisions(decisions) {
  const out = [];
  for (const g of GROUPS) {
    const rows = (decisions || []).filter((d) => d.group === g.key);
    if (rows.length) out.push({ ...g, rows });
  }
  const known = new Set(GROUPS.map((g) => g.key));
  const other = (decisions || []).filter((d) => !known.has(d.group));
  if (other.length) out.push({ key: 'other', title: 'Other', rows: other });
  return out;
}

/** "label: brief", the line a decision shows folded. */
export function decisionLine(d) {
  return `${d.label}: ${d.brief}`;
}

function seconds(v) {
  return typeof v === 'number' && v > 0 ? `${v.toFixed(3)} s/token` : '—';
}

function hits(v) {
  return typeof v === 'number' && v >= 0 ? `${v.toFixed(0)} %` : '—';
}

/** The rows of the predicted-vs-measured table: [{label, predicted, measured}]. */
export function speedRows(plan) {
  const p = (plan && plan.predicted) || {};
  const m = (plan && plan.measured) || null;
  const rows = [
    { key: 'speed', label: 'Decode', predicted: seconds(p.s_per_token), measured: m ? seconds(m.s_per_token) : '—' },
  ];
  if ('cache_hit_pct' in p || (m && m.cache_hit_pct >= 0)) {
    rows.push({ key: 'hits', label: 'Cache hits', predicted: hits(p.cache_hit_pct), measured: m ? hits(m.cache_hit_pct) : '—' });
  }
  if ('s_per_token_worst' in p) {
    rows.push({ key: 'worst', label: 'Worst case', predicted: seconds(p.s_per_token_worst), measured: '' });
  }
  return rows;
}

/** The line under the table: what the measured figures are. */
export function measuredNote(plan) {
  const m = plan && plan.measured;
  if (!m) return 'Measured figures appear after the model has answered once.';
  return `Measured over the last complete answer (${m.tokens} tokens).`;
}

/** What the screen says about where this plan came from. */
export function originNote(plan) {
  if (!plan) return '';
  if (plan.from_last_load) return 'The plan the loaded model was loaded with.';
  if (plan.cached) return 'The last plan measured.';
  return 'Measured just now.';
}
