// The settings form, generated entirely from GET /api/params, saved with
// PUT /api/config. Nothing here names a setting: rows, groups, units, special
// values and choices all come from the parameter table.

import { h, byId, fill } from './dom.js';
import {
  FILTERS, groupRows, rowVisible, displayValue, typicalText, numberMode, hasModes,
  parseNumber, sameValue, commandLine, labelsOf,
} from './settingsmodel.js';

const SCOPE_TEXT = { session: 'applies when the model is next loaded', request: 'applies to the next message' };

export class SettingsView {
  constructor({ api, onLoadAgain }) {
    this.api = api;
    this.onLoadAgain = onLoadAgain;
    this.params = [];
    this.config = null;
    this.filter = 'form';
    this.edits = new Map();
    this.rejected = {};
    this.root = byId('view-settings');
    this.build();
  }

  build() {
    this.filterSelect = h(
      'select',
      { id: 'level-filter', on: { change: () => { this.filter = this.filterSelect.value; this.renderForm(); } } },
      FILTERS.map((f) => h('option', { value: f.value, text: f.text })),
    );
    this.status = h('span', { class: 'settings-status', role: 'status', id: 'settings-status' });
    this.saveButton = h('button', { class: 'primary', id: 'settings-save', disabled: true, on: { click: () => this.save() } }, 'Save');
    this.discardButton = h('button', { id: 'settings-discard', disabled: true, on: { click: () => this.discard() } }, 'Discard changes');
    this.reloadBanner = h('div', { class: 'banner banner-warn', id: 'reload-banner', hidden: true });
    this.invalidBanner = h('div', { class: 'banner banner-error', id: 'invalid-banner', role: 'alert', hidden: true });
    this.groups = h('div', { class: 'settings-groups', id: 'settings-groups' });
    this.command = h('pre', { class: 'command', id: 'command' });
    this.copyButton = h('button', { id: 'copy-command', on: { click: () => this.copyCommand() } }, 'Copy as command');
    this.root.append(
      h('div', { class: 'settings-head' },
        h('div', { class: 'settings-bar' },
          h('h2', { class: 'view-title', text: 'Settings' }),
          h('label', { class: 'filter' }, 'Show ', this.filterSelect),
          h('span', { class: 'spacer' }),
          this.status, this.discardButton, this.saveButton),
        this.reloadBanner,
        this.invalidBanner),
      this.groups,
      h('section', { class: 'command-box' },
        h('div', { class: 'command-head' }, h('h3', { text: 'The same settings as a command line' }), this.copyButton),
        this.command),
    );
  }

  setParams(params) {
    this.params = params;
    this.renderForm();
  }

  /** A new config from the server; the person's unsaved edits are kept. */
  setConfig(config, { fromEvent = false } = {}) {
    this.config = config;
    const editing = this.root.contains(document.activeElement) && document.activeElement.matches('input, select');
    if (!fromEvent || (!this.edits.size && !editing)) this.renderForm();
    this.renderBanners();
  }

  param(key) {
    return this.params.find((p) => p.key === key);
  }

  value(key) {
    if (this.edits.has(key)) return this.edits.get(key);
    return this.config ? this.config.values[key] : undefined;
  }

  renderBanners() {
    const c = this.config;
    if (!c) return;
    const keys = c.reload_required ? c.reload_keys || [] : [];
    this.reloadBanner.hidden = !keys.length;
    if (keys.length) {
      this.reloadBanner.replaceChildren(
        h('span', { text: `Not applied yet: ${labelsOf(this.params, keys).join(', ')}. The loaded model keeps its earlier values until it is loaded again.` }),
        h('button', { id: 'load-again', on: { click: () => this.onLoadAgain() } }, 'Load again'),
      );
    }
    this.invalidBanner.hidden = c.valid !== false;
    this.invalidBanner.textContent = c.valid === false ? c.error : '';
    this.command.textContent = commandLine(c.args);
  }

  renderForm() {
    if (!this.params.length || !this.config) return;
    const userKeys = this.config.user_keys || [];
    const groups = groupRows(this.params, this.filter, userKeys);
    fill(this.groups, 
      ...groups.map((g) =>
        h('section', { class: 'group', dataset: { group: g.key } },
          h('h3', { class: 'group-title', text: g.label }),
          g.help ? h('p', { class: 'group-help', text: g.help }) : null,
          ...g.rows.map((p) => this.row(p, g.readOnly)))),
    );
    this.renderBanners();
    this.updateDirty();
  }

  row(p, readOnly) {
    const userKeys = this.config.user_keys || [];
    const launchKeys = this.config.launch_keys || [];
    const id = `f-${p.key}`;
    const rejectedText = this.rejected[p.key];
    const tags = [];
    if (launchKeys.includes(p.key)) tags.push('from the command line');
    else if (userKeys.includes(p.key)) tags.push('set by you');
    if (!readOnly && p.scope === 'session') tags.push(SCOPE_TEXT[p.scope]);
    const typical = typicalText(p);
    const control = readOnly ? h('input', { id, type: 'text', readonly: true, value: displayValue(p, this.value(p.key)), class: 'readonly' }) : this.control(p, id);
    const reset = !readOnly && userKeys.includes(p.key)
      ? h('button', { class: 'link-button', title: `Back to the default (${displayValue(p, p.default)})`, on: { click: () => this.reset(p.key) } }, 'Use default')
      : null;
    return h(
      'div',
      { class: ['row', this.edits.has(p.key) && 'dirty', rejectedText && 'rejected'], dataset: { key: p.key } },
      h('div', { class: 'row-head' },
        h('label', { for: id, class: 'row-label', text: p.label }),
        ...tags.map((t) => h('span', { class: 'tag', text: t }))),
      h('div', { class: 'row-control' }, control, reset),
      h('p', { class: 'row-help' }, p.help || '', typical ? h('span', { class: 'typical', text: ` (${typical})` }) : null),
      p.details ? h('details', { class: 'row-details' }, h('summary', { text: 'More' }), h('p', { text: p.details })) : null,
      h('p', { class: 'row-default', text: `Default: ${displayValue(p, p.default) || '—'}` }),
      h('p', { class: 'row-rejected', role: 'alert', hidden: !rejectedText, text: rejectedText || '' }),
    );
  }

  control(p, id) {
    const value = this.value(p.key);
    const edit = (v) => this.edit(p, v);
    if (p.type === 'bool') {
      return h('label', { class: 'switch' },
        h('input', { id, type: 'checkbox', checked: value === true, on: { change: (e) => edit(e.target.checked) } }),
        h('span', { class: 'switch-text', text: value === true ? 'on' : 'off' }));
    }
    if (p.type === 'choice') {
      return h('select', { id, on: { change: (e) => edit(e.target.value) } },
        (p.choices || []).map((c) => h('option', { value: c.value, text: c.label, selected: c.value === value })));
    }
    if (p.type === 'int' || p.type === 'float') return this.numberControl(p, id, value);
    return h('input', { id, type: 'text', value: value ?? '', spellcheck: 'false', on: { input: (e) => edit(e.target.value) } });
  }

  numberControl(p, id, value) {
    const mode = numberMode(p, value);
    const unit = p.unit ? h('span', { class: 'unit', text: p.unit }) : null;
    const input = h('input', {
      id: hasModes(p) ? `${id}-number` : id,
      type: 'text',
      inputmode: p.type === 'int' ? 'numeric' : 'decimal',
      class: 'number',
      value: mode === 'number' && value !== undefined ? String(value) : '',
      placeholder: typicalText(p) ? `${p.typical.min ?? ''}–${p.typical.max ?? ''}` : '',
      hidden: mode !== 'number',
      on: { input: (e) => this.edit(p, parseNumber(p, e.target.value)) },
    });
    if (!hasModes(p)) return h('span', { class: 'number-wrap' }, input, unit);
    const options = [];
    if (p.accepts_auto) options.push(h('option', { value: 'auto', text: 'auto', selected: mode === 'auto' }));
    (p.special || []).forEach((s, i) => options.push(h('option', { value: `special:${i}`, text: s.label, selected: mode === `special:${i}` })));
    options.push(h('option', { value: 'number', text: p.unit ? `a value in ${p.unit}` : 'a value', selected: mode === 'number' }));
    const select = h('select', {
      id,
      class: 'mode',
      on: {
        change: (e) => {
          const m = e.target.value;
          input.hidden = m !== 'number';
          unit && (unit.hidden = m !== 'number');
          if (m === 'auto') this.edit(p, 'auto');
          else if (m.startsWith('special:')) this.edit(p, p.special[Number(m.slice(8))].value);
          else {
            input.focus();
            if (input.value.trim()) this.edit(p, parseNumber(p, input.value));
          }
        },
      },
    }, options);
    if (unit) unit.hidden = mode !== 'number';
    return h('span', { class: 'number-wrap' }, select, input, unit);
  }

  edit(p, v) {
    const saved = this.config.values[p.key];
    if (sameValue(v, saved)) this.edits.delete(p.key);
    else this.edits.set(p.key, v);
    const row = this.groups.querySelector(`.row[data-key="${CSS.escape(p.key)}"]`);
    if (row) {
      row.classList.toggle('dirty', this.edits.has(p.key));
      const sw = row.querySelector('.switch-text');
      if (sw) sw.textContent = v === true ? 'on' : 'off';
    }
    this.updateDirty();
  }

  updateDirty() {
    const n = this.edits.size;
    this.saveButton.disabled = n === 0;
    this.discardButton.disabled = n === 0;
    if (n) this.status.textContent = n === 1 ? '1 unsaved change' : `${n} unsaved changes`;
  }

  discard() {
    this.edits.clear();
    this.rejected = {};
    this.status.textContent = '';
    this.renderForm();
  }

  async save() {
    if (!this.edits.size) return;
    const values = Object.fromEntries(this.edits);
    this.saveButton.disabled = true;
    this.status.textContent = 'Saving…';
    try {
      const result = await this.api.json('PUT', '/api/config', { values });
      this.applyResult(result, Object.keys(values));
    } catch (e) {
      this.status.textContent = e.message;
      this.saveButton.disabled = false;
    }
  }

  async reset(key) {
    try {
      const result = await this.api.json('PUT', '/api/config', { reset: [key] });
      this.edits.delete(key);
      this.applyResult(result, [key]);
    } catch (e) {
      this.status.textContent = e.message;
    }
  }

  applyResult(result, sentKeys) {
    const rejected = result.rejected || {};
    this.rejected = {};
    for (const key of sentKeys) {
      if (rejected[key]) this.rejected[key] = rejected[key];
      else this.edits.delete(key);
    }
    this.config = result;
    const nRejected = Object.keys(this.rejected).length;
    this.renderForm();
    this.status.textContent = nRejected ? (nRejected === 1 ? 'One value was not accepted.' : `${nRejected} values were not accepted.`) : 'Saved.';
  }

  /** Show one row (the context advice links here) and put the cursor in it. */
  focusField(key) {
    const p = this.param(key);
    if (!p) return;
    if (!rowVisible(p, this.filter, this.config ? this.config.user_keys : [])) {
      this.filter = 'debug';
      this.filterSelect.value = 'debug';
      this.renderForm();
    }
    const row = this.groups.querySelector(`.row[data-key="${CSS.escape(key)}"]`);
    if (!row) return;
    row.scrollIntoView({ block: 'center' });
    row.classList.add('highlight');
    setTimeout(() => row.classList.remove('highlight'), 2000);
    const input = row.querySelector('input:not([hidden]), select');
    if (input) input.focus();
  }

  async copyCommand() {
    const text = this.command.textContent;
    try {
      await navigator.clipboard.writeText(text);
      this.copyButton.textContent = 'Copied';
    } catch {
      const range = document.createRange();
      range.selectNodeContents(this.command);
      const sel = window.getSelection();
      sel.removeAllRanges();
      sel.addRange(range);
      this.copyButton.textContent = 'Selected: copy with Ctrl+C';
    }
    setTimeout(() => { this.copyButton.textContent = 'Copy as command'; }, 2000);
  }
}
