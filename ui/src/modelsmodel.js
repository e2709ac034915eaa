// The Models screen's logic, pure: sizes in words, a catalog row's actions, the verdict's
// colour, what a `download` event does to a row. Unit-tested in test/modelsmodel.test.js.

/** Decimal gigabytes, as the spec labels Resume ("Resume (X of Y GB)"). */
export function fmtGB(bytes) {
  if (!bytes) return '0 GB';
  const gb = bytes / 1e9;
  return `${gb >= 10 ? gb.toFixed(0) : gb >= 0.1 ? gb.toFixed(1) : gb.toFixed(3)} GB`;
}

/** The verdict codes a UI colours by; a code it does not know gets no colour. */
export const FIT_CODES = ['fits', 'no_streaming', 'will_not_fit', 'no_disk', 'not_a_model', 'unknown'];

export function fitClass(fit) {
  return FIT_CODES.includes(fit) ? `fit-${fit}` : '';
}

/**
 * What a catalog row offers, from the listing's row and the live download (if any):
 * [{action, label}] in order. `download` is the last `download` event of this entry.
 */
export function catalogActions(row, download) {
  const running = download ? download.state === 'running' : row.status === 'downloading';
  if (running) return [{ action: 'cancel', label: 'Cancel' }];
  const out = [];
  if (row.status === 'on_disk') return out;
  if (row.partial) {
    out.push({ action: 'download', label: `Resume (${fmtGB(row.received)} of ${fmtGB(row.bytes)})` });
    out.push({ action: 'delete-partial', label: 'Delete partial download' });
  } else {
    out.push({ action: 'download', label: row.bytes ? `Download (${fmtGB(row.bytes)})` : 'Download' });
  }
  if (row.added) out.push({ action: 'forget', label: 'Forget' });
  return out;
}

/** The progress a row shows: {value, max, text} or null when nothing runs. */
export function progressOf(download) {
  if (!download || download.state !== 'running') return null;
  const parts = [download.total ? `${fmtGB(download.received)} of ${fmtGB(download.total)}` : fmtGB(download.received)];
  if (download.rate) parts.push(`${(download.rate / 1e6).toFixed(1)} MB/s`);
  if (typeof download.eta_s === 'number') parts.push(`${Math.ceil(download.eta_s)} s left`);
  if (download.file) parts.push(download.file);
  return { value: download.received, max: download.total || 0, text: parts.join(' · '), error: download.error || '' };
}

/** A local-model row's name as DELETE /api/models/local/ takes it. */
export function localKey(m) {
  return m.folder ? `${m.folder}/${m.name}` : m.name;
}

/** Whether the page is served to this machine (the link and folders forms are local-only). */
export function isLoopbackHost(hostname) {
  const h = String(hostname || '').toLowerCase();
  return h === 'localhost' || h === '[::1]' || h === '::1' || /^127\.\d+\.\d+\.\d+$/.test(h);
}
