// The Settings screen's compute backends: what ggml registered at this start, what the
// installed packs did when loaded, and the release feed's packs for this machine (read
// only when the person asks), installed with their progress from `backend` events.
// Every word about a pack is the server's (its title, its errors); the routes answer
// this computer only, so a page from another device says so instead.

import { h, fill } from './dom.js';

const STAGE_TEXT = { download: 'Downloading', check: 'Checking the archive', unpack: 'Unpacking', done: 'Installed', error: 'Failed' };

/** A size in MiB or KiB, for a person. */
export function sizeText(bytes) {
  if (!bytes) return '';
  if (bytes >= 1 << 20) return `${(bytes / (1 << 20)).toFixed(1)} MiB`;
  return `${Math.max(1, Math.round(bytes / 1024))} KiB`;
}

/** What one `backend` event says, in words: "Downloading 40 %", "Failed: why". */
export function progressText(ev) {
  if (!ev) return '';
  const stage = STAGE_TEXT[ev.stage] || ev.stage;
  if (ev.stage === 'error') return `${stage}: ${ev.error}`;
  if (ev.stage === 'download' && ev.total) return `${stage} ${Math.floor((100 * (ev.received || 0)) / ev.total)} %`;
  return stage;
}

export class BackendsView {
  constructor({ api, root }) {
    this.api = api;
    this.data = null;
    this.error = '';
    this.progress = new Map();
    this.installing = null;
    this.opened = false;
    this.body = h('div', { id: 'backends-body' });
    this.checkButton = h('button', { id: 'backends-check', on: { click: () => this.load(true) } }, 'Check for packs');
    this.box = h('section', { class: 'card backends-box', id: 'backends' },
      h('div', { class: 'command-head' }, h('h3', { text: 'Compute backends' }), this.checkButton),
      this.body);
    root.append(this.box);
  }

  /** The Settings screen was shown: read what is there (never the network) once. */
  open() {
    if (this.opened) return;
    this.opened = true;
    this.load(false);
  }

  async load(refresh) {
    this.checkButton.disabled = true;
    try {
      this.data = await this.api.get(refresh ? '/api/backends?refresh=1' : '/api/backends');
      this.error = '';
    } catch (e) {
      this.error = e.code === 'local_only' ? 'Backend packs are managed on the computer the server runs on.' : e.message;
    } finally {
      this.checkButton.disabled = false;
    }
    this.render();
  }

  async install(id, force) {
    this.installing = id;
    this.progress.set(id, { id, stage: 'download', received: 0, total: 0 });
    this.render();
    try {
      await this.api.json('POST', `/api/backends/${encodeURIComponent(id)}/install`, force ? { force: true } : {});
      this.installing = null;
      await this.load(false);
    } catch (e) {
      this.progress.set(id, { id, stage: 'error', error: e.message });
    } finally {
      this.installing = null;
      this.render();
    }
  }

  onEvent(ev) {
    if (!ev || typeof ev.id !== 'string') return;
    this.progress.set(ev.id, ev);
    this.render();
  }

  packRow(p) {
    const state = p.installed ? (p.current ? 'installed' : `installed (${p.installed_version}), an update is offered`) : (p.applies ? '' : 'does not apply to this machine');
    const busy = this.installing !== null;
    const label = p.installed && p.current ? 'Install again' : (p.applies ? 'Install' : 'Install anyway');
    return h('div', { class: 'lib-row backend-pack', dataset: { id: p.id } },
      h('span', { class: 'model-name', text: p.title }),
      h('span', { class: 'muted small', text: [p.version, sizeText(p.size), state].filter(Boolean).join(' · ') }),
      h('span', { class: 'muted small backend-progress', role: 'status', text: progressText(this.progress.get(p.id)) }),
      h('button', { class: p.applies ? 'primary' : '', disabled: busy, on: { click: () => this.install(p.id, !p.applies) } }, label));
  }

  render() {
    const d = this.data;
    if (this.error && !d) {
      fill(this.body, h('p', { class: 'muted', id: 'backends-error', text: this.error }));
      return;
    }
    if (!d) return;
    const parts = [h('p', { id: 'backends-registered', text: `Registered at this start: ${d.registered.join(', ') || 'none'} (${d.target}).` })];
    for (const l of d.load || []) {
      parts.push(h('p', { class: l.loaded ? 'muted small' : 'row-rejected', text: l.loaded ? `Pack ${l.id}: ${l.library} loaded (${l.backend}).` : `Pack ${l.id}: ${l.library || 'nothing'} was not loaded: ${l.error}` }));
    }
    if (d.restart_required) parts.push(h('div', { class: 'banner banner-warn', id: 'backends-restart', text: 'A pack was installed: restart the server to use it.' }));
    if (this.error) parts.push(h('p', { class: 'row-rejected', text: this.error }));
    if (d.feed_error) parts.push(h('p', { class: 'row-rejected', id: 'backends-feed-error', text: d.feed_error }));
    if (d.feed) {
      parts.push(h('p', { class: 'muted small', text: `Release feed ${d.feed.version}, published ${d.feed.published}.` }));
      parts.push(d.packs.length ? h('div', { class: 'lib-list', id: 'backend-packs' }, d.packs.map((p) => this.packRow(p)))
        : h('p', { class: 'muted', text: 'The feed offers no pack for this machine.' }));
    } else {
      parts.push(h('p', { class: 'muted small', text: 'Check for packs to read the release feed (nothing is read until you do).' }));
    }
    fill(this.body, parts);
  }
}
