// Time-series charts with uPlot. Each series differs by dash pattern as well as colour, and every chart comes with
// its numbers as a table, so a chart reads without colour and without sight.
import uPlot from "./vendor/uPlot.esm.js";
import {h, shown, table} from "./dom.js";

const COLOURS = ["#0a5bd3", "#b3261e", "#1a7f37", "#8250df", "#9a6700", "#0f766e", "#c2410c", "#57606a"];
// A value axis's steps, 1, 2, 2.5 and 5 times 16 powers of ten from `smallest` up (written as uPlot writes its own,
// +"2.5e-6"). Counts step from 1 (no fractions) and US dollars from a micro-dollar, the smallest amount shown: finer
// ticks read "$0.00", "$0.00", "$0.000001". Up to 5e15: uPlot draws no value axis when no step is large enough, as
// with steps ending at 1 billion and a bucket of 20 billion tokens.
const steps = (smallest) => Array.from({length: 16}, (_, i) => [1, 2, 2.5, 5].map((m) => +`${m}e${i + smallest}`))
  .flat();
const STEPS = {count: steps(0).filter(Number.isInteger), usd: steps(-6)};
const DASHES = [[], [10, 5], [2, 4], [12, 4, 2, 4], [6, 3], [1, 3], [16, 6], [4, 8]];

// times: bucket starts (unix seconds); series: [{label, values}] with one value per time; format: value -> text.
// unit: "count" (requests, tokens), whose axis never shows fractions, "usd", never finer than a micro-dollar, or null
// (uPlot's steps); summed: false for values that do not add up (latency), whose total is not told; a null value is a
// gap.
export function timeChart({id, title, times, series, format, bucketLabel, unit = null, summed = true}) {
  const total = series.reduce((sum, s) => sum + s.values.reduce((a, b) => a + b, 0), 0);
  const plotBox = h("div", {class: "plot", role: "img", "aria-label": `${title}: chart` +
    (summed ? `; total ${format(total)}. ` : ". ") + "The numbers are in the table below it."});
  const numbers = table(`${title} per ${bucketLabel}`, [bucketLabel === "hour" ? "Hour (UTC)" : "Day (UTC)",
    ...series.map((s) => s.label)],
  times.map((t, i) => [stamp(t, bucketLabel), ...series.map((s) => format(s.values[i]))]), {empty: "No data."});
  const figure = h("figure", {class: "chart", id},
    h("figcaption", {}, h("h2", {}, title)),
    series.length ? plotBox : h("p", {class: "empty"}, "No requests in this period."),
    h("details", {}, h("summary", {}, "Show the numbers"), numbers));
  if (!series.length) return figure;

  let plot = null;
  const bucket = bucketLabel === "hour" ? 3600 : 86400;
  // A single bucket (today, per day) gets its own width around it: uPlot's range for one time spans 1,000 days, with
  // the point on the chart's left edge.
  const xRange = (u, min, max) => u.data[0].length === 1 ? [u.data[0][0] - bucket / 2, u.data[0][0] + bucket / 2]
    : [min, max];
  const options = (width) => ({
    width, height: Math.max(180, Math.min(280, Math.round(width * 0.35))),
    scales: {x: {time: true, range: xRange}, y: {range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1]}},
    padding: [null, 40, null, null],  // room for the last time's label, centred on the plot's right edge
    tzDate: (seconds) => uPlot.tzDate(new Date(seconds * 1000), "Etc/UTC"),  // the tables say UTC too
    axes: [timeAxis(bucketLabel),
      {values: (u, values) => values.map(format), size: valueAxisSize, incrs: STEPS[unit]}],
    // The legend's text is set by uPlot, not h(): shown() here.
    series: [{}, ...series.map((s, i) => ({
      label: shown(s.label), stroke: COLOURS[i % COLOURS.length], dash: DASHES[i % DASHES.length], width: 2,
      points: {show: true, size: 5}, value: (u, v) => v === null || v === undefined ? "—" : format(v),
    }))],
    legend: {live: false},
  });
  new ResizeObserver(([entry]) => {
    const width = Math.floor(entry.contentRect.width);
    if (width <= 0) return;
    if (plot === null) {
      plot = new uPlot(options(width), [times, ...series.map((s) => s.values)], plotBox);
      keyboardLegend(plot);
    } else plot.setSize({width, height: options(width).height});
  }).observe(plotBox);
  return figure;
}

// uPlot hides and shows a series by a click on its legend entry: a keyboard user gets the same with Tab and Enter or
// Space, and a screen reader hears whether the series is shown. The time series has no entry (legend.live false).
function keyboardLegend(plot) {
  plot.root.querySelectorAll(".u-legend tr.u-series > th").forEach((label, i) => {
    const pressed = () => label.setAttribute("aria-pressed", String(plot.series[i + 1].show));
    label.tabIndex = 0;
    label.setAttribute("role", "button");
    pressed();
    label.addEventListener("click", pressed);  // after uPlot's own listener, which toggles the series
    label.addEventListener("keydown", (event) => {
      if (event.key !== "Enter" && event.key !== " ") return;
      event.preventDefault();  // Space would scroll the page
      label.click();
    });
  });
}

// The value axis as wide as its widest label: a fixed width cut the first characters off "$1,250.00" or
// "≈ 1,500 ms". At least 70 px, room for half the date under the time axis's first tick. uPlot asks again with the
// labels of each new size; from the third time on, it keeps the last.
function valueAxisSize(u, values, axisIndex, cycle) {
  const axis = u.axes[axisIndex];
  if (cycle > 1) return axis._size;
  u.ctx.font = axis.font[0];
  const widest = Math.max(0, ...(values ?? []).map((text) => u.ctx.measureText(text).width)) / devicePixelRatio;
  return Math.max(70, Math.ceil(axis.ticks.size + axis.gap + widest) + 4);
}

// Past 4 weeks, ticks go by calendar months and years (uPlot aligns a step of 30 or 365 days to the 1st of a month,
// in UTC here): with steps ending at 56 days, a period of a few years per day (or a year per hour) had no step wide
// enough and its time axis no label at all.
const LONG_STEPS = [...[1, 2, 3, 6].map((months) => months * 30 * 86400),
  ...[1, 2, 5, 10, 20, 50].map((years) => years * 365 * 86400)];
const HOUR_STEPS = [...[1, 2, 3, 6, 12, 24, 48, 168, 336, 672].map((hours) => hours * 3600), ...LONG_STEPS];
const DAY_STEPS = [...[1, 2, 7, 14, 28].map((days) => days * 86400), ...LONG_STEPS];

// The time axis in UTC, as the tables: per day, days only (a day's total is not a value at its midnight); per hour,
// 24-hour times, with the date under each midnight and the first tick.
function timeAxis(bucketLabel) {
  const perDay = bucketLabel !== "hour";
  return {
    // A tick's date is as wide as 80 px: so far apart where every tick may carry one (more than two days shown).
    label: perDay ? "Day (UTC)" : "Hour (UTC)", labelSize: 20,
    space: (u, i, min, max) => perDay || max - min > 2 * 86400 ? 80 : 50,
    incrs: perDay ? DAY_STEPS : HOUR_STEPS,
    values: (u, splits) => splits.map((t, i) => {
      const text = new Date(t * 1000).toISOString();
      if (perDay) return text.slice(0, 10);
      return i === 0 || t % 86400 === 0 ? `${text.slice(11, 16)}\n${text.slice(0, 10)}` : text.slice(11, 16);
    }),
  };
}

function stamp(unixSeconds, bucketLabel) {
  const text = new Date(unixSeconds * 1000).toISOString().replace("T", " ");
  return bucketLabel === "hour" ? text.slice(0, 16) : text.slice(0, 10);
}
