// Bundles src/index.js (with uPlot and its CSS) into ONE ES module:
// ../tb_plugin/static/index.js, served by the plugin at /data/plugin/memory_hierarchy/index.js.
// TensorBoard's CSP allows scripts from 'self' only, so nothing is loaded from elsewhere;
// uPlot's CSS is bundled as text and injected as a <style> element (style-src allows it).
import { build } from 'esbuild';
import { mkdirSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const outdir = join(here, '..', 'tb_plugin', 'static');

rmSync(outdir, { recursive: true, force: true });
mkdirSync(outdir, { recursive: true });

await build({
  entryPoints: [join(here, 'src', 'index.js')],
  outfile: join(outdir, 'index.js'),
  bundle: true,
  format: 'esm',
  platform: 'browser',
  target: ['es2020'],
  loader: { '.css': 'text' },
  minify: true,
  sourcemap: 'linked',
  legalComments: 'eof',
  logLevel: 'info',
});
