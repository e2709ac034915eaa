// The Models screen's library: the models on this machine (load, unload, delete with a
// confirm), the catalog (download, cancel, resume, delete partial, a live progress bar
// from `download` events), "Add from Hugging Face" (search → files → inspect verdict →
// add → download), "Add from a link" and the folders, both offered to a loopback page
// only (the server keeps those routes to this machine). Every word about a verdict is
// the server's; the page only colours it by its code.

import { h, fill } from './dom.js';
import { fmtGB, fitClass, catalogActions, progressOf, localKey, isLoopbackHost } from './modelsmodel.js';

const ROLE_TEXT = { projector: 'image projector', draft: 'draft head', other: 'not a model', '': 'not readable' };

export class ModelsLibrary {
  constructor({ api, host, onLoad }) {
    this.api = api;
    this.host = host;
    this.onLoad = onLoad;
    this.listing = null;
    this.info = null;
    this.downloads = new Map(); // catalog id -> last download event
    this.confirming = '';       // the local model whose delete waits for a yes
    this.local = isLoopbackHost(location.hostname);
    this.build();
  }

  build() {
    this.localList = h('div', { class: 'lib-list', id: 'local-models' });
    this.otherList = h('div', { class: 'lib-list', id: 'local-others' });
    this.catalogList = h('div', { class: 'lib-list', id: 'catalog' });
    this.msg = h('p', { class: 'model-message', role: 'alert', id: 'library-message', hidden: true });
    this.hfInput = h('input', { id: 'hf-query', type: 'text', spellcheck: 'false', placeholder: 'owner/repository, a link to one, or words to search for', on: { keydown: (e) => { if (e.key === 'Enter') this.find(); } } });
    this.hfToken = h('input', { id: 'hf-token', type: 'password', autocomplete: 'off', placeholder: 'token (gated models only)' });
    this.hfResults = h('div', { class: 'lib-list', id: 'hf-results' });
    this.hfVerdict = h('div', { class: 'verdict', id: 'hf-verdict', hidden: true });
    this.urlInput = h('input', { id: 'url-input', type: 'text', spellcheck: 'false', placeholder: 'https://…/model.gguf' });
    this.modelsDir = h('input', { id: 'folders-models', type: 'text', spellcheck: 'false' });
    this.scanDirs = h('textarea', { id: 'folders-scan', rows: 2, spellcheck: 'false' });
    this.foldersNote = h('p', { class: 'muted small', id: 'folders-note' });
    this.host.append(
      this.msg,
      h('section', { class: 'card' }, h('h3', { text: 'On this machine' }), this.localList,
        h('h4', { class: 'lib-sub', text: 'Files that are not loaded on their own' }), this.otherList),
      h('section', { class: 'card' }, h('h3', { text: 'Catalog' }), this.catalogList),
      h('section', { class: 'card', id: 'hf-card' },
        h('h3', { text: 'Add from Hugging Face' }),
        h('div', { class: 'path-row' }, this.hfInput, this.hfToken,
          h('button', { id: 'hf-find', class: 'primary', on: { click: () => this.find() } }, 'Find')),
        this.hfResults, this.hfVerdict),
      this.local ? h('section', { class: 'card', id: 'url-card' },
        h('h3', { text: 'Add from a link' }),
        h('div', { class: 'path-row' }, this.urlInput,
          h('button', { id: 'url-add', on: { click: () => this.addUrl() } }, 'Add'))) : null,
      this.local ? h('section', { class: 'card', id: 'folders-card' },
        h('h3', { text: 'Folders' }),
        h('label', { for: 'folders-models', class: 'field-label', text: 'Models folder (downloads land here; empty for the default)' }),
        this.modelsDir,
        h('label', { for: 'folders-scan', class: 'field-label', text: 'Other folders to list models from, one per line (only read)' }),
        this.scanDirs, this.foldersNote,
        h('button', { id: 'folders-save', on: { click: () => this.saveFolders() } }, 'Save folders')) : null,
    );
  }

  async refresh() {
    try {
      this.setListing(await this.api.get('/api/models'));
    } catch (e) {
      this.show(e.message, true);
    }
  }

  show(text, error) {
    this.msg.hidden = !text;
    this.msg.textContent = text || '';
    this.msg.classList.toggle('error', Boolean(error));
  }

  state(info) {
    const before = this.info && this.info.model ? this.info.model.path : '';
    this.info = info;
    const now = info.model ? info.model.path : '';
    if (before !== now && this.listing) this.renderLocal();
  }

  download(ev) {
    this.downloads.set(ev.id, ev);
    if (ev.state !== 'running') this.refresh();
    else this.renderRow(ev.id);
  }

  setListing(listing) {
    this.listing = listing;
    const f = listing.folders || {};
    if (document.activeElement !== this.modelsDir) this.modelsDir.value = f.chosen_models_dir || '';
    if (document.activeElement !== this.scanDirs) this.scanDirs.value = (f.chosen_scan_dirs || []).join('\n');
    this.modelsDir.disabled = Boolean(f.models_dir_at_launch);
    this.foldersNote.textContent = `Models are kept in ${listing.models_dir}${f.models_dir_at_launch ? ' (set when the server was started)' : ''}.`
      + (f.launch_scan_dirs && f.launch_scan_dirs.length ? ` Also listed from the start: ${f.launch_scan_dirs.join(', ')}.` : '');
    this.renderLocal();
    this.renderCatalog();
  }

  // -- on this machine ----------------------------------------------------------------

  renderLocal() {
    const rows = this.listing ? this.listing.local : [];
    const loaded = this.info && this.info.model ? this.info.model.path : '';
    const models = rows.filter((m) => m.role === 'model');
    const others = rows.filter((m) => m.role !== 'model');
    fill(this.localList, models.length ? models.map((m) => this.localRow(m, loaded)) : h('p', { class: 'muted', text: 'No model files yet: download one below.' }));
    fill(this.otherList, others.length ? others.map((m) => this.localRow(m, loaded)) : h('p', { class: 'muted small', text: 'None.' }));
  }

  localRow(m, loaded) {
    const key = localKey(m);
    const inModelsDir = this.listing && m.dir === this.listing.models_dir;
    const isLoaded = loaded && m.files.includes(loaded);
    const facts = [fmtGB(m.bytes), m.arch || '', m.shards > 1 ? `${m.files.length} of ${m.shards} files` : '',
      m.role !== 'model' ? ROLE_TEXT[m.role] || m.role : (m.streamable ? 'experts stream' : 'plain mmap'),
      m.complete ? '' : 'incomplete'].filter(Boolean).join(' · ');
    const actions = [];
    if (m.role === 'model' && m.complete) {
      actions.push(isLoaded
        ? h('button', { class: 'lib-unload', on: { click: () => this.unload() } }, 'Unload')
        : h('button', { class: 'lib-load primary', on: { click: () => this.load(m.path) } }, 'Load'));
    }
    if (inModelsDir && this.local) {
      if (this.confirming === key) {
        actions.push(h('span', { class: 'confirm-text', text: `Delete ${fmtGB(m.bytes)} for good?` }),
          h('button', { class: 'danger lib-confirm-delete', on: { click: () => this.deleteLocal(key) } }, 'Delete'),
          h('button', { class: 'lib-keep', on: { click: () => { this.confirming = ''; this.renderLocal(); } } }, 'Keep'));
      } else {
        actions.push(h('button', { class: 'lib-delete', on: { click: () => { this.confirming = key; this.renderLocal(); } } }, 'Delete…'));
      }
    }
    return h('div', { class: ['lib-row', isLoaded ? 'lib-loaded' : ''], dataset: { key, role: m.role } },
      h('div', { class: 'lib-main' },
        h('div', { class: 'lib-name', text: m.name }),
        h('div', { class: 'lib-facts', text: facts }),
        h('div', { class: 'lib-where', text: m.folder ? `${m.dir}/${m.folder}` : m.dir }),
        m.error ? h('div', { class: 'lib-error', text: m.error }) : null),
      h('div', { class: 'lib-actions' }, actions));
  }

  async load(path) {
    this.show('');
    try {
      await this.api.json('POST', '/api/session/load', { model: path });
      if (this.onLoad) this.onLoad(path);
    } catch (e) {
      this.show(e.message, true);
    }
  }

  async unload() {
    try {
      await this.api.json('POST', '/api/session/unload', {});
    } catch (e) {
      this.show(e.message, true);
    }
  }

  async deleteLocal(key) {
    this.confirming = '';
    try {
      await this.api.json('DELETE', `/api/models/local/${key.split('/').map(encodeURIComponent).join('/')}`);
      this.show('');
    } catch (e) {
      this.show(e.message, true);
    }
    await this.refresh();
  }

  // -- the catalog --------------------------------------------------------------------

  renderCatalog() {
    const rows = this.listing ? this.listing.catalog : [];
    fill(this.catalogList, rows.map((r) => this.catalogRow(r)));
  }

  renderRow(id) {
    const row = this.listing && this.listing.catalog.find((r) => r.id === id);
    const el = this.catalogList.querySelector(`[data-id="${CSS.escape(id)}"]`);
    if (row && el) el.replaceWith(this.catalogRow(row));
  }

  catalogRow(r) {
    const ev = this.downloads.get(r.id);
    const live = ev && ev.state === 'running' ? ev : null;
    const progress = progressOf(live);
    const status = live ? 'downloading' : r.status;
    const note = ev && ev.state === 'error' ? `The download stopped: ${ev.error}` : r.note;
    const buttons = catalogActions(r, ev && (ev.state === 'running' ? ev : null))
      .map((a) => h('button', { class: ['lib-act', `act-${a.action}`, a.action === 'download' ? 'primary' : ''], dataset: { action: a.action }, on: { click: () => this.act(a.action, r) } }, a.label));
    return h('div', { class: 'lib-row', dataset: { id: r.id, status } },
      h('div', { class: 'lib-main' },
        h('div', { class: 'lib-name' }, h('span', { text: r.title }), ' ', h('span', { class: 'pill', text: r.quant || '?' }), ' ',
          h('span', { class: `pill status-${status}`, text: { on_disk: 'on disk', downloading: 'downloading', available: r.partial ? 'partial' : 'available' }[status] || status })),
        h('div', { class: 'lib-facts', text: [r.bytes ? fmtGB(r.bytes) : 'size unknown', r.files.length > 1 ? `${r.files.length} files` : r.file].join(' · ') }),
        r.blurb ? h('div', { class: 'lib-blurb', text: r.blurb }) : null,
        r.chat_format ? h('div', { class: 'lib-format', dataset: { format: r.chat_format }, text: `Chat format: ${r.chat_format_name || r.chat_format} (reasoning and tool calls read in it)` }) : null,
        progress ? h('div', { class: 'dl-progress' },
          h('progress', { class: 'dl-bar', max: String(progress.max || 1), value: String(progress.max ? progress.value : 0) }),
          h('span', { class: 'dl-text', text: progress.text }),
          progress.error ? h('div', { class: 'dl-error', text: progress.error }) : null) : null,
        note ? h('div', { class: 'lib-error', text: note }) : null),
      h('div', { class: 'lib-actions' }, buttons));
  }

  async act(action, r) {
    this.show('');
    const id = encodeURIComponent(r.id);
    try {
      if (action === 'download') {
        const ev = await this.api.json('POST', '/api/models/download', { id: r.id, token: this.hfToken.value || undefined });
        this.download(ev);
      } else if (action === 'cancel') {
        await this.api.json('DELETE', `/api/models/download/${id}`);
      } else if (action === 'delete-partial') {
        await this.api.json('DELETE', `/api/models/partial/${id}`);
        await this.refresh();
      } else if (action === 'forget') {
        await this.api.json('DELETE', `/api/hf/entry/${id}`);
        await this.refresh();
      }
    } catch (e) {
      this.show(e.message, true);
    }
  }

  // -- Hugging Face ---------------------------------------------------------------------

  token() {
    return this.hfToken.value ? { token: this.hfToken.value } : {};
  }

  async find() {
    const text = this.hfInput.value.trim();
    if (!text) return;
    this.hfVerdict.hidden = true;
    fill(this.hfResults, h('p', { class: 'muted', text: 'Asking the site…' }));
    try {
      this.showFiles(await this.api.json('POST', '/api/hf/models', { repo: text, ...this.token() }));
    } catch (e) {
      if (e.code !== 'not_a_repo') {
        fill(this.hfResults, h('p', { class: 'error', text: e.message }));
        return;
      }
      try {
        this.showRepos(await this.api.json('POST', '/api/hf/search', { query: text, ...this.token() }));
      } catch (e2) {
        fill(this.hfResults, h('p', { class: 'error', text: e2.message }));
      }
    }
  }

  showRepos(found) {
    if (!found.repos.length) {
      fill(this.hfResults, h('p', { class: 'muted', text: `Nothing with GGUF files matches "${found.query}".` }));
      return;
    }
    fill(this.hfResults, found.repos.map((r) => h('div', { class: 'lib-row hf-repo', dataset: { repo: r.id } },
      h('div', { class: 'lib-main' },
        h('div', { class: 'lib-name', text: r.id }),
        h('div', { class: 'lib-facts', text: `${r.downloads} downloads · ${r.likes} likes${r.gated ? ' · needs a token' : ''}${r.modified ? ` · ${r.modified.slice(0, 10)}` : ''}` })),
      h('div', { class: 'lib-actions' }, h('button', { class: 'hf-open', on: { click: () => { this.hfInput.value = r.id; this.find(); } } }, 'Files')))));
  }

  showFiles(listing) {
    this.repo = listing;
    fill(this.hfResults,
      h('p', { class: 'muted small', text: `${listing.repo} (${listing.revision})` }),
      listing.models.map((m) => h('div', { class: ['lib-row', 'hf-model', m.name === listing.file ? 'lib-loaded' : ''], dataset: { name: m.name } },
        h('div', { class: 'lib-main' },
          h('div', { class: 'lib-name', text: m.name }),
          h('div', { class: 'lib-facts', text: [m.quant, fmtGB(m.bytes), m.count > 1 ? `${m.files.length} of ${m.count} files` : '', m.role !== 'model' ? ROLE_TEXT[m.role] : ''].filter(Boolean).join(' · ') })),
        h('div', { class: 'lib-actions' }, h('button', { class: 'hf-inspect', on: { click: () => this.inspect(m.name) } }, 'Inspect')))));
  }

  async inspect(name) {
    this.hfVerdict.hidden = false;
    fill(this.hfVerdict, h('p', { class: 'muted', text: `Reading the header of ${name}…` }));
    try {
      const r = await this.api.json('POST', '/api/hf/inspect', { repo: this.repo.repo, revision: this.repo.revision, name, ...this.token() });
      const v = r.verdict;
      const m = r.model;
      this.hfVerdict.className = ['verdict', fitClass(v.fit)].filter(Boolean).join(' ');
      this.hfVerdict.dataset.fit = v.fit;
      fill(this.hfVerdict,
        h('div', { class: 'verdict-headline', id: 'verdict-headline', text: v.headline }),
        h('div', { class: 'verdict-name', text: `${r.name} · ${fmtGB(r.bytes)}${m.readable ? ` · ${m.arch}${m.is_moe ? `, ${m.n_expert} experts, ${m.n_expert_used} per token` : ''}` : ''}` }),
        h('p', { class: 'verdict-line', text: v.memory }),
        h('p', { class: 'verdict-line', text: v.disk }),
        v.downloadable ? h('button', { id: 'hf-add', class: 'primary', on: { click: () => this.add(name) } }, 'Add to the catalog and download') : null);
    } catch (e) {
      fill(this.hfVerdict, h('p', { class: 'error', text: e.message }));
    }
  }

  async add(name) {
    try {
      const added = await this.api.json('POST', '/api/hf/add', { repo: this.repo.repo, revision: this.repo.revision, name, ...this.token() });
      await this.refresh();
      const ev = await this.api.json('POST', '/api/models/download', { id: added.id, ...this.token() });
      this.download(ev);
      this.show(`${added.title} is in the catalog and downloading.`);
    } catch (e) {
      this.show(e.message, true);
      await this.refresh();
    }
  }

  // -- a link, the folders ------------------------------------------------------------

  async addUrl() {
    const url = this.urlInput.value.trim();
    if (!url) return;
    try {
      const added = await this.api.json('POST', '/api/models/url', { url });
      this.urlInput.value = '';
      this.show(`${added.title} is in the catalog: download it there.`);
      await this.refresh();
    } catch (e) {
      this.show(e.message, true);
    }
  }

  async saveFolders() {
    const body = { scan_dirs: this.scanDirs.value.split('\n').map((s) => s.trim()).filter(Boolean) };
    if (!this.modelsDir.disabled) body.models_dir = this.modelsDir.value.trim();
    try {
      this.setListing(await this.api.json('PUT', '/api/models/folders', body));
      this.show('Folders saved.');
    } catch (e) {
      this.show(e.message, true);
    }
  }
}
