// What the three GDN prefill sources share (prep.cu, gdn_prefill.cu, portable.cu): the q / k / v element type
// (-D IN_T), the chunk and head sizes, and the padded shared-memory row strides of their 16-bit tiles.
// plan.py mirrors CH, KST and BST in its shared-memory sizes (the kernels static_assert those sizes).
#pragma once
#include "common.cuh"

#ifndef IN_T
#define IN_T QF_BF16  // q, k, v, o element type: QF_BF16 or QF_HALF
#endif

typedef qf_type<IN_T>::t elem;
typedef unsigned int u32;

#define CH 64           // chunk length
#define DK 128          // key / value head dim
#define KST (DK + 8)    // smem row stride (elements) of K, Q tiles: 272 B, ldmatrix conflict-free
#define BST 72          // 16-bit row stride of the 64-wide T and P tiles
