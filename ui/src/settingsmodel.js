// The settings form's logic, from GET /api/params and /api/config (no DOM).
//
// Everything a person reads comes from the parameter table: labels, units, group
// titles and help, special values by label, choices, typical ranges. The UI keeps
// no threshold of its own: a value it cannot read as a number is sent as written,
// and the server's `rejected` reason is what the person sees.

export const LEVELS = ['basic', 'advanced', 'experimental', 'debug'];

/** The filters the form offers: the form's own rows, or every row up to a level. */
export const FILTERS = [
  { value: 'form', text: 'The form’s settings' },
  { value: 'basic', text: 'Level: basic' },
  { value: 'advanced', text: 'Up to level: advanced' },
  { value: 'experimental', text: 'Up to level: experimental' },
  { value: 'debug', text: 'Everything (up to debug)' },
];

/**
 * Whether a row shows under `filter`. The form's rows are those with `form: true`;
 * a row the person has set shows whatever the filter, so a value set from the command
 * line is never hidden.
 */
export function rowVisible(param, filter, userKeys = []) {
  if (userKeys.includes(param.key)) return true;
  if (filter === 'form') return param.form === true;
  const rank = LEVELS.indexOf(param.level);
  const limit = LEVELS.indexOf(filter);
  return rank >= 0 && limit >= 0 && rank <= limit;
}

/** Groups in `group_order`, each with its visible rows in table order. */
export function groupRows(params, filter = 'form', userKeys = []) {
  const groups = new Map();
  params.forEach((p, i) => {
    if (!groups.has(p.group)) {
      groups.set(p.group, {
        key: p.group,
        label: p.group_label || p.group,
        help: p.group_help || '',
        order: Number.isFinite(p.group_order) ? p.group_order : 1e9,
        first: i,
        readOnly: p.group_read_only === true,
        rows: [],
      });
    }
    if (rowVisible(p, filter, userKeys)) groups.get(p.group).rows.push(p);
  });
  return [...groups.values()]
    .filter((g) => g.rows.length)
    .sort((a, b) => a.order - b.order || a.first - b.first);
}

/** The special entry whose value is `value`, if any. */
export function specialFor(param, value) {
  return (param.special || []).find((s) => s.value === value || String(s.value) === String(value));
}

/** A value as a person reads it: special and choice labels, units, auto. */
export function displayValue(param, value) {
  if (value === undefined || value === null || value === '') return '';
  if (value === 'auto' && param.accepts_auto) return 'auto';
  const special = specialFor(param, value);
  if (special) return special.label;
  if (param.type === 'bool') return value ? 'on' : 'off';
  if (param.type === 'choice') {
    const choice = (param.choices || []).find((c) => c.value === value);
    return choice ? choice.label : String(value);
  }
  return param.unit ? `${value} ${param.unit}` : String(value);
}

/** "typically 1500–8192 MiB" from `typical`, else '' (limits are not a range to show). */
export function typicalText(param) {
  const t = param.typical;
  if (!t || (t.min === undefined && t.max === undefined)) return '';
  const unit = param.unit ? ` ${param.unit}` : '';
  if (t.min !== undefined && t.max !== undefined) return `typically ${t.min}–${t.max}${unit}`;
  if (t.min !== undefined) return `typically ${t.min}${unit} or more`;
  return `typically up to ${t.max}${unit}`;
}

/** The mode a numeric row is in: 'auto', 'special:<i>', or 'number'. */
export function numberMode(param, value) {
  if (value === 'auto' && param.accepts_auto) return 'auto';
  const i = (param.special || []).findIndex((s) => s.value === value);
  return i >= 0 ? `special:${i}` : 'number';
}

/** Whether a row needs the mode picker beside its number field. */
export function hasModes(param) {
  return Boolean(param.accepts_auto) || Boolean(param.special && param.special.length);
}

/** The value to send for what a person typed in a number field. */
export function parseNumber(param, raw) {
  const text = String(raw).trim();
  if (text === '') return text;
  if (param.accepts_auto && text.toLowerCase() === 'auto') return 'auto';
  if (!/^[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$/i.test(text)) return text; // the server words the refusal
  const n = Number(text);
  return Number.isFinite(n) ? n : text;
}

/** The same value as the server's? (1 and 1.0, "auto" and "auto") */
export function sameValue(a, b) {
  if (typeof a === 'number' && typeof b === 'number') return a === b;
  return JSON.stringify(a) === JSON.stringify(b);
}

/** Quote one argument for a POSIX shell, only when it needs it. */
export function shellQuote(arg) {
  const s = String(arg);
  if (s !== '' && /^[A-Za-z0-9_\-+=.,:/@%]+$/.test(s)) return s;
  return `'${s.replace(/'/g, `'\\''`)}'`;
}

/** `args` of GET /api/config as the command line a person can paste. */
export function commandLine(args, program = 'bmoe-cli') {
  return [program, ...(args || []).map(shellQuote)].join(' ');
}

/** Labels of `keys` from the table, in the order given. */
export function labelsOf(params, keys) {
  return (keys || []).map((k) => (params.find((p) => p.key === k) || {}).label || k);
}
