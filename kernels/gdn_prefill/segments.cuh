// The sequence split shared by both walks: where each segment of a long sequence starts its walk.
// Included after the including file has defined CH.
//
// A sequence of nchunks chunks is cut into nseg segments of ceil(nchunks / nseg) chunks. Segment s > 0
// starts from a zero state w chunks before its first chunk, where w is the fewest chunks whose gates
// multiply the earlier state by at most 2^-SEG_DROP_BITS (2^-30: below fp32 resolution, since every
// (I - beta k k^T) factor has norm <= 1 with beta in (0, 1) and |k| <= 1), or from the initial state at
// chunk 0 when the walk back reaches it. If some boundary needs more than half a segment of warm-up
// (weak decay), the split is refused for that (sequence, head) and the caller walks it unsplit: exact
// in every case.
#pragma once

#ifndef SEG_DROP_BITS
#define SEG_DROP_BITS 30  // (tests lower it to see that the split is taken)
#endif
#define SEG_DECAY (-0.6931471805599453f * SEG_DROP_BITS)
#define SEG_MIN_CHUNKS 8  // shorter sequences are never split
#define SEG_MAX 16        // most segments per sequence

// Segments a sequence of nchunks chunks is cut into when nseg are asked for (plan.seg_count mirrors it; the
// plan asks for one where every sequence of an unpacked call is shorter, so the output kernel takes nseg as is).
__host__ __device__ __forceinline__ int seg_count(int nseg, int nchunks) {
    return nchunks >= SEG_MIN_CHUNKS ? nseg : 1;
}

struct SegWalk {
    int cw, cbeg, cend;  // walk chunks [cw, cend), write o for [cbeg, cend)
};

// Called by every thread of the block (it has a block barrier). Fg: the prep kernel's [slot][Hv][4][CH]
// vectors (G is row 0; G_end of chunk c is Fg[((slot0 + c) Hv + h) 4 CH + CH - 1]). warm: SEG_MAX ints of
// shared memory. Returns false when some boundary needs more than half a segment of warm-up.
__device__ __forceinline__ bool seg_plan(const float* __restrict__ Fg, int slot0, int Hv, int h, int nchunks,
                                         int nseg, int sg, int* warm, SegWalk& sw) {
    const int per = (nchunks + nseg - 1) / nseg, maxw = max(1, per / 2);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int s = warp + 1; s < nseg; s += nwarps) {  // warp s - 1 (mod nwarps) walks back from boundary s
        int found = -1;
        if (s * per < nchunks) {
            const int cb = s * per, lo = max(0, cb - maxw);
            const float* gend = Fg + ((long long)slot0 * Hv + h) * 4 * CH + (CH - 1);  // G_end of chunk 0
            const long long cstride = (long long)Hv * 4 * CH;
            float run = 0.f;  // sum of G_end over the chunks walked so far
            for (int base = cb - 1; base >= lo && found < 0; base -= 32) {
                const int j = base - lane;
                const bool in = j >= lo;
                float x = in ? gend[j * cstride] : 0.f;
#pragma unroll
                for (int off = 1; off < 32; off <<= 1) {
                    const float y = __shfl_up_sync(0xffffffffu, x, off);
                    if (lane >= off) x += y;
                }
                x += run;  // log of the decay from the start of chunk j to the boundary
                const unsigned hit = __ballot_sync(0xffffffffu, in && x <= SEG_DECAY);
                if (hit) found = base - (__ffs(hit) - 1);
                run = __shfl_sync(0xffffffffu, x, 31);
            }
            if (found < 0 && lo == 0) found = 0;  // reached the sequence start: begin there, from h0
        } else {
            found = 0;  // an empty tail segment
        }
        if (lane == 0) warm[s] = found;
    }
    __syncthreads();
    bool ok = true;
    for (int s = 1; s < nseg; ++s) ok = ok && warm[s] >= 0;
    sw.cbeg = min(sg * per, nchunks);
    sw.cend = min(sw.cbeg + per, nchunks);
    sw.cw = sg ? min(warm[sg], sw.cbeg) : 0;
    __syncthreads();  // warm may sit in space the walk reuses
    return ok;
}
